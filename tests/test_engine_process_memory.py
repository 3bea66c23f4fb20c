"""The engine process's side of the pipe (``_PipedEngine``), run in this process over a real pipe:
requests that end, however they end, leave nothing behind (a long-running server's memory stays flat)."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from specdec import LLM, SamplingParams
from specdec.server.async_engine import Prompt
from specdec.server.engine_process import _PipedEngine
from specdec.server.limits import ServerLimits
from tiny_models import make_model, perturbed_copy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("piped")
    target = make_model(root / "target", "llama")
    draft = perturbed_copy(target, root / "draft", 0.01)
    return LLM(str(target), max_num_seqs=4,
               speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})


def test_every_request_that_ends_leaves_no_handle_or_sequence_behind(llm):
    parent, child = multiprocessing.Pipe()
    loop = _PipedEngine(llm.engine, child, ServerLimits(kv_cache_memory=64 * 2**20), release_when_idle=True)
    loop.start()
    try:
        params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                  SamplingParams(temperature=1, seed=3, max_tokens=5, n=2, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)]  # aborted below
        for rid, p in enumerate(params):
            loop.add(rid, [Prompt([3, 4, 5 + rid], p)], time.perf_counter())
        assert len(loop.handles) == 4
        finished: dict[int, int] = {}
        deadline = time.monotonic() + 60
        while sum(finished.values()) < 4:  # choices: 1 + 2 + 1
            assert time.monotonic() < deadline, f"requests did not finish: {finished}"
            if not parent.poll(0.1):
                continue
            msg = parent.recv()
            for rid, ev in msg[1]:
                assert ev.error is None, ev.error
                if ev.finish_reason is not None:
                    finished[rid] = finished.get(rid, 0) + 1
        loop.abort_request(3)
        loop.drop_done()
        assert loop.handles == {}, {rid: h.state for rid, h in loop.handles.items()}
        deadline = time.monotonic() + 10
        while loop._tracks or llm.engine.has_unfinished():
            assert time.monotonic() < deadline, "the engine kept the requests' sequences"
            time.sleep(0.02)
    finally:
        loop.stop()
        parent.close()
