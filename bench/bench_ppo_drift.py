"""Greedy drift, ours vs TRL 1.12 ``PPOTrainer``: same weights and prompts, greedy generation, N PPO steps.

The parity test (tests/test_ppo_trl_parity.py) feeds both sides fixed responses; here both generate, with
the parity test's models and matched settings (copied into ``bench/ppo_sides.py``).
TRL's ``PPOTrainer.train`` builds ``GenerationConfig(do_sample=True, temperature=T + 1e-7, top_k=0,
top_p=1)`` inline, so greedy needs a patch: TRL's module-level ``batch_generation`` (the only user
of that config) is wrapped to pass a copy with ``do_sample=False`` and temperature / top-k / top-p
unset. With ``do_sample=False`` HF applies no warper, so the returned ``output.scores`` (TRL's
"old" logits) are the raw logits, what ours computes at temperature 1. Ours runs with
``do_sample: false``. Both suppress <pad>/<s>/</s> (a random policy emits them; TRL reads a
generated <pad> as the end of the response), and TRL's "old" logits are recomputed by a full
forward as in the parity test (its scores would be -inf there). Both: equal-length prompts, exactly ``--response-len`` tokens (TRL
``stop_token=None``, ours ``ignore_eos``), so TRL needs no padding; the math is the parity test's
(k1 KL 0.05, GAE 1 / 0.95, whitening, clips 0.2, vf 0.1, AdamW, 2 epochs x 2 mini-batches, no
shuffle). TRL's prompt order per step is recorded and replayed on our side.

Per step: fraction of responses identical token for token, the max |parameter difference| between
the two actors at generation time, and the step's mean score / policy loss / value loss on each side.
At the first divergence: the prefix is re-run under both sides' weights and the top-2 logit gap and
the logit difference between the two weight sets are reported (a flip needs gap < difference).

    python bench/bench_ppo_drift.py [--steps 8] [--batch 16] [--response-len 16] [--out drift.json]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np
import torch

from bench.harness import environment, markdown_table, patched, tokenizer, write_report
from bench.ppo_sides import our_trainer, trl_trainer
from bench.ppo_sides import parity_models as models  # the parity test's matched settings
from bench.ppo_sides import parity_ours_config as ours_config
from bench.ppo_sides import parity_trl_args as trl_args

# <pad>, <s>, </s>: a random policy emits them under greedy; TRL would read a generated <pad> as the
# end of the response (and move the score there), so both sides suppress them in generation
SPECIAL = [0, 1, 2]


def prompts_tensor(a):
    return torch.randint(7, 600, (a.batch, a.prompt_len), generator=torch.Generator().manual_seed(5))


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_trl(a) -> dict:
    from trl.experimental.ppo import ppo_trainer as trl_module

    tok = tokenizer()
    prompts = prompts_tensor(a)
    policy, ref, critic, reward = models("sdpa")
    out = {"orders": [], "responses": [], "weights": [], "scores": [], "losses": [], "min_gap": []}
    original_gen = trl_module.batch_generation

    def greedy_generation(model, queries, batch_size, pad_token_id, generation_config):
        greedy = copy.deepcopy(generation_config)
        greedy.do_sample, greedy.temperature, greedy.top_k, greedy.top_p = False, None, None, None
        greedy.suppress_tokens = SPECIAL if a.suppress else None
        out["weights"].append(snapshot(model))
        qr, _ = original_gen(model, queries, batch_size, pad_token_id, greedy)
        # old logits: a full forward (as ours), not the suppressed scores (-inf at SPECIAL)
        logits = model(input_ids=qr).logits[:, a.prompt_len - 1 : -1]
        top2 = logits.detach().float().clone()
        top2[..., SPECIAL] = -float("inf")
        top2 = top2.topk(2, -1).values
        out["min_gap"].append((top2[..., 0] - top2[..., 1]).min().item())
        order = [next(i for i, p in enumerate(prompts) if torch.equal(p, q)) for q in queries]
        out["orders"].append(order)
        resp = [None] * len(order)
        for row, i in zip(qr[:, a.prompt_len :].tolist(), order):
            resp[i] = row
        out["responses"].append(resp)
        return qr, logits

    original_whiten = trl_module.masked_whiten

    def spy_whiten(values, mask, shift_mean=True):
        frame = inspect.currentframe().f_back.f_locals
        out["scores"].append(frame["scores"].mean().item())
        return original_whiten(values, mask, shift_mean)

    with (
        patched(trl_module, batch_generation=greedy_generation, masked_whiten=spy_whiten),
        patched(np.random, permutation=lambda n: np.arange(n)),  # TRL's mini-batch shuffle: none
        tempfile.TemporaryDirectory() as tmp,
    ):
        args = trl_args(tmp, a.batch, a.steps, a.response_len, a.lr)
        trainer = trl_trainer(args, tok, (policy, ref, critic, reward), prompts.tolist())
        original_step = trainer.optimizer.step

        def spy_step(*s_args, **s_kwargs):
            frame = inspect.currentframe().f_back.f_locals
            out["losses"].append((frame["pg_loss"].item(), frame["vf_loss"].item()))
            return original_step(*s_args, **s_kwargs)

        trainer.optimizer.step = spy_step
        trainer.train()
    per = len(out["losses"]) // a.steps
    out["pg"] = [float(np.mean([x[0] for x in out["losses"][s * per : (s + 1) * per]])) for s in range(a.steps)]
    out["vf"] = [float(np.mean([x[1] for x in out["losses"][s * per : (s + 1) * per]])) for s in range(a.steps)]
    return out


def run_ours(a, orders) -> dict:
    from llm.utils.attention import PACKED_SDPA

    tok = tokenizer()
    prompts = prompts_tensor(a)
    policy, ref, critic, reward = models(PACKED_SDPA)
    if a.suppress:
        policy.generation_config.suppress_tokens = SPECIAL  # generate() builds on the model's config
    B = a.batch
    config = ours_config(B, a.steps, a.lr, do_sample=False, max_response_length=a.response_len, ignore_eos=True)
    labels = [f"prompt {i}" for i in range(len(prompts))]
    trainer = our_trainer(config, prompts.tolist(), tok, (policy, ref, critic, reward), labels)
    trainer.prompt_stream.indices = lambda step: orders[step]  # the rollout source draws its prompts from it
    out = {"responses": [], "weights": [], "scores": [], "pg": [], "vf": []}
    collect, captured = trainer.source.collect, []
    trainer.source.collect = lambda step, round=0: captured.append(collect(step, round)) or captured[-1]
    for step in range(a.steps):
        trainer.history.clear()
        out["weights"].append(snapshot(policy))
        metrics = trainer.train_step()
        samples = captured[-1].scored.samples  # the step's RolloutBatch (rollout.py)
        resp = [None] * B
        for r, i in zip(samples.response_ids, orders[step]):
            resp[i] = list(r)
        out["responses"].append(resp)
        out["scores"].append(metrics["score"])
        out["pg"].append(float(np.mean([h["loss"] for h in trainer.history if h["role"] == "actor"])))
        out["vf"].append(float(np.mean([h["loss"] for h in trainer.history if h["role"] == "critic"])))
    return out


def max_weight_diff(w1, w2) -> float:
    return max((w1[k].float() - w2[k].float()).abs().max().item() for k in w1)


@torch.no_grad()
def logits_at(weights, ids: list[int]) -> torch.Tensor:
    model, _, _, _ = models("sdpa")
    model.load_state_dict(weights)
    model.eval()
    return model(input_ids=torch.tensor([ids])).logits[0, -1].double()


@torch.no_grad()
def logit_diff(w_ours, w_trl, prompts, responses) -> float:
    """max |logit difference| between the two actors over every generated position (TRL's sequences)."""
    ids = torch.cat([prompts, torch.tensor(responses)], 1)
    diffs = []
    for w in (w_ours, w_trl):
        model, _, _, _ = models("sdpa")
        model.load_state_dict(w)
        diffs.append(model.eval()(input_ids=ids).logits[:, prompts.shape[1] - 1 : -1])
    return (diffs[0] - diffs[1]).abs().max().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=10)
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--no-suppress", dest="suppress", action="store_false", help="let both sides generate <pad>/<s>/</s>"
    )
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    trl = run_trl(a)
    ours = run_ours(a, trl["orders"])
    prompts = prompts_tensor(a)
    rows, first = [], None
    for s in range(a.steps):
        same = [ours["responses"][s][i] == trl["responses"][s][i] for i in range(a.batch)]
        pos = [
            next((j for j, (x, y) in enumerate(zip(ours["responses"][s][i], trl["responses"][s][i])) if x != y), None)
            for i in range(a.batch)
        ]
        rows.append(
            {
                "step": s,
                "identical": sum(same) / a.batch,
                "weight_diff": max_weight_diff(ours["weights"][s], trl["weights"][s]),
                "min_top2_gap": trl["min_gap"][s],
                "logit_diff": logit_diff(ours["weights"][s], trl["weights"][s], prompts, trl["responses"][s]),
                "score": (ours["scores"][s], trl["scores"][s]),
                "pg": (ours["pg"][s], trl["pg"][s]),
                "vf": (ours["vf"][s], trl["vf"][s]),
            }
        )
        if first is None and not all(same):
            first = []
            for i, j in enumerate(pos):
                if j is None:
                    continue
                prefix = prompts[i].tolist() + ours["responses"][s][i][:j]
                lo, lt = logits_at(ours["weights"][s], prefix), logits_at(trl["weights"][s], prefix)
                top_o, top_t = lo.topk(2), lt.topk(2)
                first.append(
                    {
                        "step": s,
                        "sample": i,
                        "position": j,
                        "ours_token": ours["responses"][s][i][j],
                        "trl_token": trl["responses"][s][i][j],
                        "top2_gap_ours": (top_o.values[0] - top_o.values[1]).item(),
                        "top2_gap_trl": (top_t.values[0] - top_t.values[1]).item(),
                        "logit_diff_between_sides": (lo - lt).abs().max().item(),
                    }
                )
    print(
        f"Greedy PPO drift, B={a.batch} prompts x {a.prompt_len} tokens, {a.response_len} greedy tokens, "
        f"lr {a.lr}, {a.steps} steps"
    )
    header = (
        "step | identical responses | max abs actor weight diff | max abs logit diff | min top-2 logit gap | "
        "mean score ours / TRL | abs diff score / policy loss / value loss"
    )
    table = markdown_table(
        header,
        (
            f"{r['step']} | {r['identical']:.2f} | {r['weight_diff']:.1e} | {r['logit_diff']:.1e} | "
            f"{r['min_top2_gap']:.1e} | {r['score'][0]:.5f} / {r['score'][1]:.5f} | "
            + " / ".join(f"{abs(r[k][0] - r[k][1]):.1e}" for k in ("score", "pg", "vf"))
            for r in rows
        ),
    )
    print(table)
    print("first divergence:", json.dumps(first, indent=1) if first else "none")
    report = {
        "args": vars(a),
        "rows": rows,
        "first_divergence": first,
        "environment": environment("bench/bench_ppo_drift.py", sys.argv[1:], a),
        "table_markdown": table,
    }
    write_report(a.out, report, indent=1)


if __name__ == "__main__":
    main()
