"""Request: ordered status, token writes through one method that extends block hashes."""

import pytest

from scheduler.block_hash import BlockHasher, sha256_block_hash
from scheduler.outputs import FinishReason
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams


def make(prompt, n=1, block_size=4):
    return Request("r", "r", list(prompt), SamplingParams(n=n), BlockHasher(block_size))


def test_status_order_and_finish_reasons():
    S = RequestStatus
    assert S.WAITING < S.RUNNING < S.PREEMPTED < S.FINISHED_STOPPED < S.FINISHED_LENGTH < S.FINISHED_ABORTED
    assert [s.is_finished for s in S] == [False, False, False, True, True, True]
    assert [s.finish_reason for s in S] == [None, None, None, FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT]


def test_append_extends_chained_hashes_of_full_blocks_only():
    r = make(range(6))
    assert len(r.block_hashes) == 1
    assert r.block_hashes[0] == sha256_block_hash(None, [0, 1, 2, 3])
    r.append_output_token_ids(6)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([7, 8])
    assert len(r.block_hashes) == 2
    assert r.block_hashes[1] == sha256_block_hash(r.block_hashes[0], [4, 5, 6, 7])
    assert list(r.output_token_ids) == [6, 7, 8] and r.num_tokens == 9
    assert r.all_token_ids == list(range(9))


def test_token_views_are_read_only():
    r = make(range(3))
    with pytest.raises(AttributeError):
        r.output_token_ids.append(1)  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        r.all_token_ids[0] = 5  # type: ignore[index]


def test_hash_depends_on_whole_prefix():
    a, b = make([1, 2, 3, 4, 5, 6, 7, 8]), make([9, 2, 3, 4, 5, 6, 7, 8])
    assert a.block_hashes[1] != b.block_hashes[1]  # same block tokens, other parent


def test_fork_parent_and_children():
    parent = make(range(10), n=3)
    assert parent.is_fork_parent and parent.num_seqs == 3 and parent.num_tokens_to_compute == 9
    child = parent.make_fork_child(2)
    assert child.request_id == "r-2" and child.client_request_id == "r" and child.index == 2
    assert child.sampling_params.n == 1 and not child.is_fork_parent
    assert list(child.block_hashes) == list(parent.block_hashes)
    child.append_output_token_ids([1, 2])
    assert len(child.block_hashes) == 3 and len(parent.block_hashes) == 2
