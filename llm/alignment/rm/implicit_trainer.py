"""Implicit PRM (``prm_kind: implicit``): a causal LM trained from outcome labels with the reward
``r(y) = implicit_beta * log(pi(y) / pi_ref(y))`` against a frozen reference (the math: ``implicit_loss.py``).

A batch is either solutions (a readout at every response token, part = its step, value = the record's outcome:
the ``ce`` form's items, one per solution with an outcome) or pairs (parts ``PAIR_CHOSEN`` / ``PAIR_REJECTED``: the
``dpo`` form's items, one per pair). The dev split is always solutions: its loss is the ``ce`` form's, its step
scores ``p_k = sigmoid(sum_{j<=k} r_j)``, and the evaluation adds ProcessBench and best-of-N exactly as the
discriminative PRM's (``PRMTrainer.record_metrics``, ``step_score_metrics``).

The reference is frozen (no gradient, eval mode) and never part of a checkpoint: a resume builds it as the first
run did (``implicit_reference``, else the initial model). The final save writes it once into
``output_dir/reference`` (or, when ``implicit_reference`` names a model, only that path) with ``implicit_prm.json``,
which the step scorer, the server and PPO's ``implicit_prm`` reward read (``llm.alignment.rm.implicit``).
"""

from __future__ import annotations

import torch

from llm.alignment.dpo.trainer import freeze_reference
from llm.alignment.lm import READOUT_CHUNK, full_weight, per_example_sums, readout_log_probs, token_log_probs
from llm.alignment.rm.implicit import save_implicit_prm
from llm.alignment.rm.implicit_loss import outcome_ce_loss, pair_dpo_loss, step_probabilities
from llm.alignment.rm.prm_trainer import PRMTrainer
from llm.alignment.trainer import ItemOutputs
from llm.data.encode_implicit import PAIR_CHOSEN, PAIR_REJECTED
from llm.data.packing import PackedBatch


class ImplicitPRMTrainer(PRMTrainer):
    """``ref_model``: the frozen reference; ``reference_path``: the model ``implicit_reference`` names (None: the
    reference is the initial model, saved once with the final model)."""

    last_layer_at_readouts = False  # a readout at every response token: nothing to skip
    loss_items_description = "solutions with an outcome (ce) or pairs (dpo)"

    def __init__(self, *args, ref_model: torch.nn.Module, reference_path: str | None = None, **kwargs) -> None:
        super().__init__(*args, reward_token_ids=(), **kwargs)  # no reward tokens: the evaluation is PRMTrainer's
        self.ref_model = freeze_reference(ref_model, self.args.device)
        self.reference_path = reference_path

    @staticmethod
    def is_pairs(batch: PackedBatch) -> bool:
        return bool((batch.readout_part < 0).any())

    def count_items(self, batch: PackedBatch) -> int:
        if self.is_pairs(batch):
            return batch.num_examples
        return int((~torch.isnan(self.outcomes(batch))).sum())

    @staticmethod
    def outcomes(batch: PackedBatch) -> torch.Tensor:
        """``(E,)`` each solution's outcome (the value of its readouts; NaN: unknown or none read)."""
        out = torch.full((batch.num_examples,), float("nan"), device=batch.readout_target.device)
        return out.scatter(0, batch.readout_example, batch.readout_value.float().to(out.device))

    def log_ratios(self, model, batch: PackedBatch) -> torch.Tensor:
        """``(N,)`` ``log pi - log pi_ref`` of every readout's token (the reference under no gradient)."""
        head = self.model.get_output_embeddings()
        hidden = self.readout_hidden(model, batch)
        policy, _ = readout_log_probs(hidden, batch.readout_target, full_weight(head.weight), full_weight(head.bias))
        with torch.no_grad():
            ref, _ = token_log_probs(self.ref_model, self.ref_model.get_output_embeddings(), batch, READOUT_CHUNK)
        return policy - ref

    def forward_items(self, model, batch: PackedBatch) -> ItemOutputs:
        ratios = self.log_ratios(model, batch)
        beta = self.args.implicit_beta
        if self.is_pairs(batch):
            chosen = beta * per_example_sums(ratios, batch, batch.readout_part == PAIR_CHOSEN)
            rejected = beta * per_example_sums(ratios, batch, batch.readout_part == PAIR_REJECTED)
            values = {"chosen_reward": chosen.detach(), "rejected_reward": rejected.detach()}
            return ItemOutputs(pair_dpo_loss(chosen, rejected), values)
        rewards = beta * per_example_sums(ratios, batch)
        outcomes = self.outcomes(batch)
        values = {"reward": rewards.detach(), "outcome": outcomes, "token_reward": beta * ratios.detach()}
        return ItemOutputs(outcome_ce_loss(rewards, outcomes), values, counted=~torch.isnan(outcomes))

    def example_outputs(self, batch: PackedBatch, out: ItemOutputs) -> list[dict]:
        records = batch.records.tolist()
        if "chosen_reward" in out.values:
            c, r = out.values["chosen_reward"].tolist(), out.values["rejected_reward"].tolist()
            return [{"record": rec, "chosen_reward": c[i], "rejected_reward": r[i]} for i, rec in enumerate(records)]
        examples = [{"record": rec, "step_rewards": []} for rec in records]
        for ex, part, value in zip(
            batch.readout_example.tolist(), batch.readout_part.tolist(), out.values["token_reward"].tolist()
        ):
            rewards = examples[ex]["step_rewards"]
            rewards += [0.0] * (part + 1 - len(rewards))
            rewards[part] += value
        for ex, reward, outcome in zip(examples, out.values["reward"].tolist(), out.values["outcome"].tolist()):
            ex["reward"] = reward
            ex["step_scores"] = step_probabilities(ex["step_rewards"])
            ex["_outcome"] = outcome
        return examples

    def metric_names(self) -> list[str]:
        return ["outcome_accuracy", "rewards/margins", "rewards/accuracies"]

    def metrics(self, examples: list[dict]) -> dict[str, float]:
        """Pairs: the chosen reward's margin and how often it is the larger (DPO's names); solutions: how often
        ``sigmoid(r(y)) > 0.5`` matches the outcome."""
        if not examples:
            return {}
        if "chosen_reward" in examples[0]:
            margins = [ex["chosen_reward"] - ex["rejected_reward"] for ex in examples]
            return {
                "rewards/margins": sum(margins) / len(margins),
                "rewards/accuracies": sum(m > 0 for m in margins) / len(margins),
            }
        known = [ex for ex in examples if ex["_outcome"] == ex["_outcome"]]  # NaN: no outcome
        if not known:
            return {}
        return {"outcome_accuracy": sum((ex["reward"] > 0) == (ex["_outcome"] > 0.5) for ex in known) / len(known)}

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if not _internal_call and self.args.should_save:  # the final model: its reference once, and how to read it
            save_implicit_prm(output_dir or self.args.output_dir, self.ref_model, self.reference_path, self.args)
