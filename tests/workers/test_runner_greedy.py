"""Greedy tokens of our paged runner vs Hugging Face generate, and step-layout invariance:
chunked prefill, prefix KV already in the pool, staggered arrivals, preemption resume."""

from __future__ import annotations

import pytest
from runner_helpers import (
    HfOracle,
    assert_greedy_matches,
    greedy,
    make_runner,
    prompts_of_lengths,
    run_requests,
)

from scheduler.outputs import SchedulerOutput
from workers.simple_driver import SimpleDriver

PROMPT_LENGTHS = [1, 3, 8, 17, 29, 45]  # crosses block boundaries (block_size 4) in every way
NUM_NEW_TOKENS = 20


# every oracle test runs on the all-torch reference path, on our fused C layer ops with the
# torch attention, and on the CPU default (C layer ops and our C attention kernel)
@pytest.fixture(scope="module", params=[("torch", "torch"), ("torch", "native"), ("cpu", "native")],
                ids=["torch", "native-ops", "cpu-default"])
def tiny_runner(request, tiny_model_dir):
    attention_backend, layer_ops = request.param
    return make_runner(tiny_model_dir, attention_backend=attention_backend, layer_ops=layer_ops)


@pytest.fixture(scope="module")
def tiny_oracle(tiny_model_dir):
    return HfOracle(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_prompts(tiny_runner):
    return prompts_of_lengths(PROMPT_LENGTHS, tiny_runner.model_info.vocab_size)


@pytest.fixture(scope="module")
def tiny_reference(tiny_oracle, tiny_prompts):
    return [tiny_oracle.greedy(prompt, NUM_NEW_TOKENS) for prompt in tiny_prompts]


def test_greedy_batch_matches_hf_generate(tiny_runner, tiny_prompts, tiny_reference):
    outputs = run_requests(tiny_runner, tiny_prompts, greedy(NUM_NEW_TOKENS))
    matched = [assert_greedy_matches(ours, ref) for ours, ref in zip(outputs, tiny_reference)]
    assert sum(matched) >= 0.9 * NUM_NEW_TOKENS * len(tiny_prompts), matched  # near-ties are rare here


def test_greedy_small_token_budget_mixes_prefill_chunks_and_decodes(tiny_runner, tiny_prompts, tiny_reference):
    # a budget of 16 tokens per step: long prompts are chunked while short ones already decode
    outputs = run_requests(tiny_runner, tiny_prompts, greedy(NUM_NEW_TOKENS), token_budget=16)
    for ours, ref in zip(outputs, tiny_reference):
        assert_greedy_matches(ours, ref)


def test_three_chunk_prefill_equals_full_prefill(tiny_runner, tiny_prompts):
    prompt = tiny_prompts[-1]  # 45 tokens: chunks of 15
    full = run_requests(tiny_runner, [prompt], greedy(NUM_NEW_TOKENS))
    driver = SimpleDriver(tiny_runner, prefill_chunk_size=15)
    driver.add_request("chunked", prompt, greedy(NUM_NEW_TOKENS))
    chunk_sizes = []
    while driver.has_unfinished:
        driver.step()
        chunk_sizes.append(driver.last_output.num_scheduled_tokens["chunked"])
    assert chunk_sizes[:3] == [15, 15, 15] and set(chunk_sizes[3:]) == {1}
    assert driver.requests["chunked"].output_token_ids == full[0]


def test_prefix_kv_already_in_pool_equals_computing_it(tiny_runner, tiny_prompts):
    block_size = tiny_runner.block_size
    prefix = tiny_prompts[4]  # 29 tokens: 7 full blocks + 1 token in a partial block
    suffix = tiny_prompts[2]
    computed = run_requests(tiny_runner, [prefix + suffix], greedy(NUM_NEW_TOKENS))[0]

    driver = SimpleDriver(tiny_runner)
    owner = driver.add_request("owner", prefix, greedy(1), keep_blocks=True)
    driver.run()  # the owner's prefill leaves the prefix KV in its blocks
    num_full = len(prefix) // block_size
    partial_copy = driver.allocate_blocks(1)[0]
    driver.add_request(
        "reuser", prefix + suffix, greedy(NUM_NEW_TOKENS),
        prefix_block_ids=owner.block_ids[:num_full] + [partial_copy],
        num_computed_tokens=len(prefix),
        copy_blocks=[(owner.block_ids[num_full], partial_copy)],
    )
    driver.free_blocks([partial_copy])  # the reuser holds its own reference now
    driver.step()
    assert driver.last_output.num_scheduled_tokens["reuser"] == len(suffix)  # the prefix was not recomputed
    assert driver.last_output.copy_blocks == [(owner.block_ids[num_full], partial_copy)]
    driver.run()
    assert driver.requests["reuser"].output_token_ids == computed


def test_staggered_arrivals_equal_running_alone(tiny_runner, tiny_prompts):
    alone = run_requests(tiny_runner, tiny_prompts[:3], greedy(NUM_NEW_TOKENS))
    driver = SimpleDriver(tiny_runner, token_budget=12)
    for index, prompt in enumerate(tiny_prompts[:3]):
        driver.add_request(f"r{index}", prompt, greedy(NUM_NEW_TOKENS))
        for _ in range(3):  # the next request arrives while the earlier ones decode
            driver.step()
    driver.run()
    assert [driver.requests[f"r{index}"].output_token_ids for index in range(3)] == alone


def test_preempted_request_resumes_with_its_generated_tokens(tiny_runner, tiny_prompts):
    prompt = tiny_prompts[3]
    uninterrupted = run_requests(tiny_runner, [prompt], greedy(NUM_NEW_TOKENS))[0]
    first = run_requests(tiny_runner, [prompt], greedy(7))[0]
    # comes back as a new request whose earlier outputs are part of its token ids (recomputed)
    driver = SimpleDriver(tiny_runner)
    resumed = driver.add_request("resumed", prompt, greedy(NUM_NEW_TOKENS), output_token_ids=first)
    driver.run()
    assert driver.last_output is not None
    assert resumed.output_token_ids == uninterrupted


def test_finished_requests_are_dropped_from_the_runner(tiny_runner, tiny_prompts):
    driver = SimpleDriver(tiny_runner)
    driver.add_request("short", tiny_prompts[0], greedy(2))
    driver.add_request("long", tiny_prompts[1], greedy(6))
    driver.run()
    assert "short" not in tiny_runner.requests  # sent in finished_request_ids on a later step
    assert "long" in tiny_runner.requests  # nobody told the runner yet (no step after it finished)
    # After a failed step the scheduler names every request it sent (Engine.fail_all), also one
    # whose first step failed before the worker registered it: the runner ignores that one.
    tiny_runner.execute(SchedulerOutput([], [], {}, 0, finished_request_ids={"long", "never-registered"}))
    assert "long" not in tiny_runner.requests


@pytest.mark.slow
def test_smollm2_greedy_batch_matches_hf_generate(smollm2_dir):
    from transformers import AutoTokenizer

    runner = make_runner(smollm2_dir, block_size=16, num_blocks=128, num_threads=None, attention_backend=None)
    assert runner.model_info.attention_backend == "cpu"  # the CPU default: our C kernel
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "2+2=",
                 "List three colors of the rainbow, please.",
                 "Explain what a paged KV cache is, in one sentence, for a beginner.", "Hi"]
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"])
        for q in questions
    ]
    prompts[5] = prompts[5][-3:]  # and one very short raw prompt
    assert len({len(p) for p in prompts}) == len(prompts)
    oracle = HfOracle(smollm2_dir)
    references = [oracle.greedy(prompt, 16) for prompt in prompts]
    outputs = run_requests(runner, prompts, greedy(16))
    matched = [assert_greedy_matches(ours, ref, epsilon=1e-2) for ours, ref in zip(outputs, references)]
    assert sum(matched) >= 0.75 * 16 * len(prompts), matched


def test_unknown_request_means_lost_worker_state_and_reset_forgets_all(tiny_runner, tiny_prompts):
    from scheduler.outputs import CachedRequestData, SchedulerOutput, WorkerStateLostError

    driver = SimpleDriver(tiny_runner)
    driver.add_request("kept", tiny_prompts[1], greedy(50))
    driver.step()
    assert "kept" in tiny_runner.requests
    tiny_runner.reset()  # e.g. a restarted scheduler
    assert tiny_runner.requests == {}
    with pytest.raises(WorkerStateLostError, match="'kept'"):
        driver.step()
    with pytest.raises(WorkerStateLostError, match="'ghost'"):
        tiny_runner.execute(SchedulerOutput([], [], {"ghost": 1}, 1))
    with pytest.raises(WorkerStateLostError, match="'ghost'"):
        tiny_runner.execute(SchedulerOutput([], [CachedRequestData("ghost", [], 3)], {"ghost": 1}, 1))


def test_a_small_steps_packed_index_tensors_equal_the_general_ones(tiny_model_dir, monkeypatch):
    """A CPU step of up to PACKED_STEP_MAX_TOKENS tokens builds its index tensors from two
    buffers (_packed_batch); they hold what the general path builds, in the same dtypes, and
    each is contiguous, as the kernels require. Steps mixing prompt chunks and decodes of
    sequences with block tables of different lengths."""
    import torch

    from workers import model_runner

    runner = make_runner(tiny_model_dir, attention_backend="cpu", layer_ops="native")
    prompts = prompts_of_lengths(PROMPT_LENGTHS, runner.model_info.vocab_size)
    prepare = runner._prepare_batch
    compared = []

    def both_ways(scheduler_output):
        packed = prepare(scheduler_output)
        with monkeypatch.context() as patch:
            patch.setattr(model_runner, "PACKED_STEP_MAX_TOKENS", 0)
            general = prepare(scheduler_output)
        fields = lambda batch: {  # noqa: E731
            "input_ids": batch.input_ids, "positions": batch.positions, "logits_rows": batch.logits_rows,
            **{name: getattr(batch.metadata, name)
               for name in ("slot_mapping", "block_tables", "query_start_loc", "seq_lens")}}
        if batch_tokens(packed) <= model_runner.PACKED_STEP_MAX_TOKENS:
            for name, tensor in fields(packed).items():
                expected = fields(general)[name]
                assert tensor.dtype == expected.dtype and tensor.is_contiguous(), name
                assert torch.equal(tensor, expected), name
            compared.append(packed.metadata.seq_lens.shape[0])
        assert packed.sampling_states == general.sampling_states
        return packed

    batch_tokens = lambda batch: batch.input_ids.shape[0]  # noqa: E731
    runner._prepare_batch = both_ways
    run_requests(runner, prompts, greedy(6), token_budget=24)
    assert len(compared) > 5 and max(compared) == len(prompts)


def test_a_step_says_whether_it_computes_prompt_tokens(tiny_model_dir) -> None:
    """metadata.computes_prompt (a GGUF model's prompt steps take other kernels, workers/model.py):
    true for every step with a prompt's rows, a one-token prompt's too, false once only decodes run."""
    runner = make_runner(tiny_model_dir)
    forward, steps = runner.model.forward, []

    def recorded(input_ids, positions, metadata, kv_caches, lora=None):
        steps.append((input_ids.shape[0], metadata.query_start_loc.shape[0] - 1, metadata.computes_prompt))
        return forward(input_ids, positions, metadata, kv_caches, lora)

    runner.model.forward = recorded
    run_requests(runner, prompts_of_lengths([1, 6, 20], runner.model_info.vocab_size), greedy(6), token_budget=8)
    assert steps[0] == (8, 3, True)  # the 1-token prompt, the 6-token one and a chunk of the 20
    assert all(computes for rows, sequences, computes in steps if rows > sequences)
    assert [computes for _, _, computes in steps[-4:]] == [False] * 4  # the prompts are done: decodes only
    steps.clear()
    run_requests(runner, prompts_of_lengths([1], runner.model_info.vocab_size), greedy(2))
    assert steps == [(1, 1, True), (1, 1, False)]  # one row either way: only the runner knows which
