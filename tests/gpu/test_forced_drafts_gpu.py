"""Grammar-forced drafts on a GPU (fp32, the embedded model): the 52 schemas validate with forced drafts on, in
fewer steps, with the tokens of forced drafts off, overlap on and off; the verify rows replay verify graphs."""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.sampling_params import StructuredOutputParams  # noqa: E402
from tests.structured.schemas import SCHEMAS  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def llm():
    llm = LLM(dtype="float32", max_model_len=1024, max_num_seqs=64, seed=0, structured_forced_drafts=True)
    assert llm.engine.forced_k > 0 and llm.engine.runner.executor.verify_graphs is not None
    yield llm
    llm.shutdown()


def _run(llm, temperature: float, forced: bool, overlap: bool):
    engine = llm.engine
    engine.use_forced_drafts(forced)
    engine.overlap = overlap
    engine.scheduler.reset_prefix_cache()  # every run prefills whole prompts (the same shapes)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=96,
                             structured_output=StructuredOutputParams(json=json.dumps(s)))
              for i, s in enumerate(SCHEMAS)]
    steps, accepted = engine.num_steps, engine.forced_accepted_tokens
    try:
        outs = llm.generate([f"JSON for {json.dumps(s)}:" for s in SCHEMAS], params, use_tqdm=False)
    finally:
        engine.use_forced_drafts(True)
        engine.overlap = True
    assert engine.num_grammar_rejections == 0
    return [o.outputs[0] for o in outs], engine.num_steps - steps, engine.forced_accepted_tokens - accepted


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_drafts_keep_the_tokens_in_fewer_steps(llm, temperature):
    """A verify row runs in a graph of another row count than a decode row, so the GEMMs see other shapes; their
    fp32 rounding can flip a sample at temperature 1.0 whose two best candidates are nearly tied (as between eager
    steps and graphs, test_structured_gpu.py). Greedy rows must agree exactly, and at temperature 1.0 at least 90% of
    the requests, which a mask on the wrong row would not give."""
    off, steps_off, _ = _run(llm, temperature, forced=False, overlap=True)
    for overlap in (True, False):
        on, steps_on, accepted = _run(llm, temperature, forced=True, overlap=overlap)
        for schema, out in zip(SCHEMAS, on):
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), schema)
        differ = [i for i, (a, b) in enumerate(zip(on, off)) if list(a.token_ids) != list(b.token_ids)]
        if temperature == 0.0:
            assert not differ, f"overlap={overlap}: requests {differ} differ with forced drafts"
        else:
            assert len(differ) <= len(SCHEMAS) // 10, f"overlap={overlap}: requests {differ} differ"
        assert accepted > 0 and steps_on < steps_off, (steps_on, steps_off, accepted)
