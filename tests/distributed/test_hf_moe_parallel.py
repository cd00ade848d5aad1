"""Mixture-of-experts Hugging Face checkpoints in and out of the Megatron model under EP, TP and PP
(gloo, CPU): Qwen3-MoE with a dense first layer, Qwen2-MoE with a shared expert (tests/hf_models.py).

One launch of two processes runs the layouts ep2, tp2 (with sequence parallelism, which
Megatron-Core's MoE layer needs under TP) and pp2 one after the other (the process groups are
rebuilt between them); one launch of four runs tp2 x ep2, pp2 x ep2 and tp2 x ep2 with each
expert split over two expert-tensor-parallel ranks (etp2). For each layout and
family the model is built straight from the checkpoint, each rank reading only its slices (its
expert-parallel rank's experts), then:
- its logits (without PP) and its log-probs through the trainer's forward-only pipeline schedule
  are compared with transformers' float32 ones;
- under ep2 each rank has read exactly the dense tensors and half of the experts;
- every rank streams the full weights (weights.export_full_weights: the experts gathered from
  their expert-parallel owners), which must equal the checkpoint's tensors bit for bit;
- the model is exported as a Hugging Face checkpoint in float32: every tensor equal to the
  source's, and transformers loads it (from the ep2 and tp2 x ep2 exports) with the same logits.
Under ep2, `score` also scores records of uneven count and length over the two data-parallel
ranks (which the expert-parallel group spans: they must run their forwards in lockstep).
"""

import pytest
import torch

from tests.dist import hide_gpus, run_distributed
from tests.hf_models import MOE_FAMILIES, VOCAB, hf_log_probs, hf_logits, make_checkpoint, safetensors_tensors

pytestmark = [
    pytest.mark.distributed,
]

BATCH, SEQ, TEMPERATURE = 4, 16, 0.7
# name: (world size, (tp, pp, ep, etp)); tp > 1 runs with sequence parallelism
LAYOUTS = {"ep2": (2, (1, 1, 2, 1)), "tp2": (2, (2, 1, 1, 1)), "pp2": (2, (1, 2, 1, 1)),
           "tp2ep2": (4, (2, 1, 2, 1)), "pp2ep2": (4, (1, 2, 2, 1)), "tp2ep2etp2": (4, (2, 1, 2, 2))}
LAUNCHES = {world: [name for name, (w, _) in LAYOUTS.items() if w == world] for world in (2, 4)}


SCORED = [(3, 9), (1, 4), (2, 12), (5, 5), (4, 1)]  # (prompt, response) lengths of the scored records


def _score(checkpoint, rollouts, groups, world):
    from megatron_rlcorr import score

    args = score.parse_args(["--model", str(checkpoint), "--rollouts", str(rollouts), "--out",
                             str(rollouts.with_suffix(".out")), f"rollout.temperature={TEMPERATURE}",
                             f"parallel.ep={groups.ep_size}", "trainer.micro_batch_size=1"])
    source, recipe, records = score.prepare(args, world)
    return score.score_records(source, recipe, records, groups)


def _worker(rank, world, layouts, checkpoints, tokens, export_root, rollouts):
    hide_gpus()
    from megatron_rlcorr.model.build import build_model_chunks
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.hf import HFCheckpoint, export_hf
    from megatron_rlcorr.model.weights import export_full_weights, neutral_weight_shapes
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups
    from megatron_rlcorr.training.step import StepBatch, compute_old_log_probs

    enable_cpu_megatron()
    targets = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
    ones, zeros = torch.ones(tokens.shape), torch.zeros(tokens.shape)
    out = {}
    for layout in layouts:
        tp, pp, ep, etp = LAYOUTS[layout][1]
        groups = build_parallel_groups(tp, pp, 1, ep=ep, etp=etp, sequence_parallel=tp > 1)
        for family, directory in checkpoints.items():
            cfg = ModelConfig.from_dict({"hf_checkpoint": str(directory), "make_vocab_size_divisible_by": 1})
            source = HFCheckpoint(directory)
            chunks = build_model_chunks(cfg, groups, weights=source)
            for chunk in chunks:
                chunk.eval()
            result = {"bytes_read": source.bytes_read}
            result["log_probs"] = compute_old_log_probs(chunks, StepBatch(tokens, targets, ones, zeros, zeros),
                                                        groups=groups, micro_batch_size=2, temperature=TEMPERATURE)
            if pp == 1:
                with torch.no_grad():
                    result["logits"] = chunks[0](tokens, None, None, runtime_gather_output=True)[..., :VOCAB]
            full = export_full_weights(chunks, groups)
            reference = HFCheckpoint(directory)
            result["streamed"] = sorted(full) == sorted(neutral_weight_shapes(cfg))
            result["unequal"] = [n for n, t in full.items() if not torch.equal(t, reference.read(n).float())]
            export_hf(chunks, groups, export_root / layout / family, cfg, dtype=torch.float32)
            out[(layout, family)] = result
        if layout == "ep2":
            out["score"] = _score(checkpoints["qwen3_moe"], rollouts, groups, world)
        destroy_parallel_groups()
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    return {family: make_checkpoint(root / family, family, seed=20 + i) for i, family in enumerate(MOE_FAMILIES)}


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def reference(checkpoints, tokens):
    return {family: {"log_probs": hf_log_probs(d, tokens, TEMPERATURE), "logits": hf_logits(d, tokens)}
            for family, d in checkpoints.items()}


@pytest.fixture(scope="module")
def scoring(checkpoints, tmp_path_factory):
    """A rollout file of SCORED records on the qwen3_moe checkpoint, and transformers' log-probs."""
    import json

    gen = torch.Generator().manual_seed(2)
    records, expected = [], []
    for p, r in SCORED:
        tokens = torch.randint(0, VOCAB, (1, p + r), generator=gen)
        expected.append(hf_log_probs(checkpoints["qwen3_moe"], tokens, TEMPERATURE)[0, p - 1:])
        records.append({"prompt_ids": tokens[0, :p].tolist(), "response_ids": tokens[0, p:].tolist()})
    path = tmp_path_factory.mktemp("score") / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, expected


@pytest.fixture(scope="module")
def runs(checkpoints, tokens, scoring, tmp_path_factory):
    """{(layout, family): per-rank results, "score": per-rank scores}, and the export root."""
    export_root = tmp_path_factory.mktemp("export")
    out = {}
    for world, layouts in LAUNCHES.items():
        ranks = run_distributed(_worker, world, layouts, checkpoints, tokens, export_root, scoring[0])
        for key in ranks[0]:
            out[key] = [r[key] for r in ranks]
    return out, export_root


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_log_probs_and_logits_match_transformers(runs, reference, layout, family):
    ranks = runs[0][(layout, family)]
    last_stage = [r["log_probs"] for r in ranks if r["log_probs"] is not None]
    assert last_stage, "the last pipeline stage returns the log-probs"
    for log_probs in last_stage:
        torch.testing.assert_close(log_probs[:, :-1], reference[family]["log_probs"], atol=2e-5, rtol=0)
    for rank in ranks:
        if "logits" in rank:
            torch.testing.assert_close(rank["logits"], reference[family]["logits"], atol=2e-5, rtol=0)


def test_score_under_expert_parallelism_matches_transformers(runs, scoring):
    scored = runs[0]["score"][0]  # rank 0 holds them all
    assert len(scored) == len(SCORED)
    for got, want in zip(scored, scoring[1]):
        torch.testing.assert_close(torch.tensor(got), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_expert_parallel_rank_reads_only_its_experts(runs, checkpoints, family):
    from megatron_rlcorr.model.hf import HFCheckpoint

    shapes = HFCheckpoint(checkpoints[family]).shapes()
    nbytes = {name: 4 * torch.Size(shape).numel() for name, shape in shapes.items()}
    experts = sum(b for n, b in nbytes.items() if ".mlp.experts." in n)
    dense = sum(nbytes.values()) - experts
    for rank in runs[0][("ep2", family)]:
        assert rank["bytes_read"] == dense + experts // 2


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_rank_streams_every_expert(runs, layout, family):
    for rank in runs[0][(layout, family)]:
        assert rank["streamed"] and rank["unequal"] == []


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_float32_export_reproduces_every_tensor(runs, checkpoints, layout, family):
    exported = safetensors_tensors(runs[1] / layout / family)
    source = safetensors_tensors(checkpoints[family])
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("layout", ["ep2", "tp2ep2"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_transformers_loads_the_export_with_the_same_logits(runs, reference, tokens, layout, family):
    import transformers

    directory = runs[1] / layout / family
    _, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    torch.testing.assert_close(hf_logits(directory, tokens), reference[family]["logits"], atol=0, rtol=0)
