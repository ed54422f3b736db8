"""A token its grammar rejects (sampled without the mask: a bug, not a user error) aborts that request alone, the
same way with and without async scheduling: its tokens up to the rejected one, none after. The other requests'
outputs do not change and no KV block leaks."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.demo import default_model
from pagedllm.structured_output.manager import GrammarState


def _run(async_scheduling: bool, reject: bool, monkeypatch) -> list:
    if reject:
        real = GrammarState.accept
        rejected: list[GrammarState] = []

        def accept(self, token_id):  # the first matcher to reach its third token rejects it
            if not rejected and self.matcher is not None and self.num_accepted == 2:
                rejected.append(self)
                return False
            return real(self, token_id)

        monkeypatch.setattr(GrammarState, "accept", accept)
    llm = LLM(default_model(), dtype="float32", device="cpu", async_scheduling=async_scheduling)
    regex = StructuredOutputsParams(regex="[a-z]{12}")
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=regex),
        SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=regex),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    ]
    outs = llm.generate(["def f(x):", "class A:", "import os"], params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.engine_core.scheduler.kv.usage() == 0.0
    monkeypatch.undo()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_rejected_token_aborts_only_its_request(async_scheduling, monkeypatch):
    clean = _run(async_scheduling, False, monkeypatch)
    hit = _run(async_scheduling, True, monkeypatch)
    aborted = [i for i, (_, reason) in enumerate(hit) if reason == "abort"]
    assert len(aborted) == 1 and aborted[0] in (0, 1)  # one of the constrained requests
    i = aborted[0]
    assert len(hit[i][0]) == 3 and hit[i][0] == clean[i][0][:3]  # its tokens up to the rejected one, none after
    assert [h for j, h in enumerate(hit) if j != i] == [c for j, c in enumerate(clean) if j != i]

