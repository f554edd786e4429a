"""Workers: the tensors side of the server (torch; Triton on GPU).

Model loading (workers.loader), the paged Llama-family model (workers.model), attention
kernels (workers.kernels), the sampler (workers.sampler) and the ModelRunner
(workers.model_runner) that executes one SchedulerOutput per engine step.
workers/actor.py is the only module here that imports ray.
"""
