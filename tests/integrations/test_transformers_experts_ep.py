"""``use_static_moe(model, ep_group=group)`` on two gloo ranks: every rank holds the same tiny Qwen3-MoE and runs
the same inputs (transformers' replicated run); each keeps and runs only its E/2 experts. Logits against the
one-rank static_moe model and eager, greedy tokens through ``generate`` (KV cache: decode steps of one token, so
one rank's share is a padding row), the module holding only its slice, ``torch.compile(fullgraph=True)`` tracing
the all-gather, gpt-oss's transposed, biased experts, and the collective refusals (experts not divisible by S,
ranks that disagree)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "transformers",
    minversion="5.0",
    reason="the transformers integration tests need transformers>=5 (pip install 'static_moe[transformers]')",
)

from static_moe.testing.distributed import run_ranks  # noqa: E402
from static_moe.testing.tiny_qwen3_moe import tiny_qwen3_moe  # noqa: E402

E, K, STEPS = 4, 2, 3


def _tiny_qwen3(num_experts: int = E):
    return tiny_qwen3_moe(num_experts=num_experts, num_experts_per_tok=K)  # seed 0: the same model on every rank


def _worker(rank: int, size: int) -> dict:
    import copy
    import gc
    import weakref

    import torch.distributed as dist

    from static_moe.integrations.transformers_experts import (
        close_static_moe,
        experts_modules,
        static_moe_layer,
        use_static_moe,
    )
    from static_moe.testing.distributed import expect_raises
    from static_moe.testing.numeric import calc_diff

    group = dist.group.WORLD
    alone = [dist.new_group([r]) for r in range(size)][rank]  # the one-rank reference, inside the distributed run
    out: dict = {}
    model = _tiny_qwen3()
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(3))  # T = 5: padded to 6
    greedy = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        one = use_static_moe(copy.deepcopy(model), ep_group=alone)
        one_logits = one(ids, use_cache=False).logits
        one_tokens = one.generate(ids, **greedy)
        close_static_moe(one)
        del one

        full = {name: m.gate_up_proj.detach()[rank * 2 : rank * 2 + 2].clone() for name, m in experts_modules(model)}
        alive = [weakref.ref(t) for _, m in experts_modules(model) for t in (m.gate_up_proj, m.down_proj)]
        use_static_moe(model, ep_group=group)
        gc.collect()
        out["freed"] = sum(r() is None for r in alive) == len(alive)
        out["slices"] = []
        for name, m in experts_modules(model):
            layer = static_moe_layer(m)
            gu, d = m.gate_up_proj, m.down_proj
            out["slices"].append(
                (
                    layer.ep_size,
                    layer.num_local_experts,
                    layer.expert_offset,
                    tuple(gu.shape),
                    gu.untyped_storage().nbytes() == gu.numel() * gu.element_size(),
                    d.untyped_storage().nbytes() == d.numel() * d.element_size(),
                    torch.equal(gu, full[name]),
                )
            )
        ep_logits = model(ids, use_cache=False).logits
        out["vs_one"] = calc_diff(ep_logits, one_logits)
        out["vs_eager"] = calc_diff(ep_logits, eager)
        out["tokens_equal"] = torch.equal(model.generate(ids, **greedy), one_tokens)

        torch._dynamo.reset()
        compiled = torch.compile(lambda i: model(i, use_cache=False).logits, fullgraph=True, backend="aot_eager")
        out["compiled_equal"] = torch.equal(compiled(ids), ep_logits)
        torch._dynamo.reset()
        close_static_moe(model)

        # gpt-oss: transposed weights, interleaved gate/up, biases sliced with the experts, swiglu_oai.
        from static_moe.testing.experts_families import families, tiny_model

        oss, _ = tiny_model("gpt_oss", families()["gpt_oss"][0])
        oss_ids = torch.randint(3, 100, (2, 3), generator=torch.Generator().manual_seed(3))
        oss_eager = oss(input_ids=oss_ids, use_cache=False).logits
        one = use_static_moe(copy.deepcopy(oss), ep_group=alone)
        oss_one = one(input_ids=oss_ids, use_cache=False).logits
        close_static_moe(one)
        use_static_moe(oss, ep_group=group)
        oss_ep = oss(input_ids=oss_ids, use_cache=False).logits
        out["oss"] = (calc_diff(oss_ep, oss_one), calc_diff(oss_ep, oss_eager))
        out["oss_slices"] = [
            (tuple(m.gate_up_proj.shape), tuple(m.gate_up_proj_bias.shape), static_moe_layer(m).w13_bias is not None)
            for _, m in experts_modules(oss)
        ]
        close_static_moe(oss)

        # Refusals, on every rank: rank 1's model has 3 experts, which do not split over 2 ranks (rank 0's check
        # passes: it raises the ValueError naming rank 1); then rank 1 asks for another weight format.
        odd = _tiny_qwen3(num_experts=3 if rank == 1 else E)
        out["uneven"] = expect_raises(ValueError, lambda: use_static_moe(odd, ep_group=group), "do not split")
        other = _tiny_qwen3()
        fmt = "fp8" if rank == 1 else "bf16"
        out["disagree"] = expect_raises(
            ValueError, lambda: use_static_moe(other, weight_format=fmt, ep_group=group), "weight_format"
        )
        out["untouched"] = all(static_moe_layer(m) is None for _, m in experts_modules(other))
    return out


def test_ep_group_two_ranks():
    for rank, got in enumerate(run_ranks(_worker, 2, timeout=180, pg_timeout=30)):
        assert got["slices"] and all(s == (2, 2, 2 * rank, (2, 256, 128), True, True, True) for s in got["slices"]), (
            rank,
            got["slices"],
        )
        assert got["freed"], f"rank {rank}: the whole model's expert tensors are still alive"
        assert got["vs_one"] < 1e-4 and got["vs_eager"] < 1e-4, (rank, got["vs_one"], got["vs_eager"])
        assert got["tokens_equal"] and got["compiled_equal"], rank
        assert got["oss"][0] < 1e-4 and got["oss"][1] < 1e-4, (rank, got["oss"])
        assert got["oss_slices"] and all(s[1][0] == 2 and s[0][0] == 2 and s[2] for s in got["oss_slices"]), got
        assert "(3)" in got["uneven"] and (rank == 1) != ("failed on group rank(s) [1]" in got["uneven"]), got["uneven"]
        assert "fp8" in got["disagree"] and got["untouched"], got["disagree"]
