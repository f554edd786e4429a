"""Engine core: pure Python, stdlib only (no ray, no torch).

Modules, bottom up: sampling_params, outputs (the step contract), block_hash, request,
block_pool, kv_cache_manager, config, stats, scheduler, engine (in-process asyncio loop),
testing (FakeRunner). Import what you need from the modules themselves; this package
file stays empty so that `import scheduler` stays cheap.
"""
