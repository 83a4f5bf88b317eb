"""Supervised fine-tuning on packed rows: cross-entropy on response tokens only.

One item = one target token: the loss is the sum of token NLLs divided by the global target-token
count of the optimizer step, so accumulation 4 x 1 == batch 4 and packing does not reweight examples.
"""

from __future__ import annotations

from llm.alignment.lm import READOUT_CHUNK, check_packed_attention, per_example_sums, token_log_probs
from llm.alignment.sft.loss import perplexity, token_nll
from llm.alignment.trainer import AlignmentTrainer, ItemOutputs
from llm.data.packing import PackedBatch


class SFTTrainer(AlignmentTrainer):
    def __init__(self, *args, readout_chunk: int = READOUT_CHUNK, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_packed_attention(self.model, "SFTTrainer")
        self.readout_chunk = readout_chunk

    def count_items(self, batch: PackedBatch) -> int:
        return batch.readout_index.numel()

    def forward_items(self, model, batch: PackedBatch) -> ItemOutputs:
        logps, hits = token_log_probs(model, self.model.get_output_embeddings(), batch, self.readout_chunk)
        loss = token_nll(logps)
        return ItemOutputs(loss, {"nll": loss.detach(), "hits": hits})

    def example_outputs(self, batch: PackedBatch, out: ItemOutputs) -> list[dict]:
        nll = per_example_sums(out.values["nll"].double(), batch).tolist()
        tokens = per_example_sums(out.values["nll"].new_ones(out.loss.shape), batch).long().tolist()
        hits = per_example_sums(out.values["hits"].double(), batch).long().tolist()
        return [
            {"record": r, "nll": s, "tokens": n, "hits": h}
            for r, s, n, h in zip(batch.records.tolist(), nll, tokens, hits)
        ]

    def metric_names(self) -> list[str]:
        return ["ppl", "accuracy"]

    def metrics(self, examples: list[dict]) -> dict[str, float]:
        if not examples:
            return {}
        tokens = sum(ex["tokens"] for ex in examples)
        # accuracy: share of answer tokens that are the model's most likely next token (PaddleNLP's SFT metric)
        return {
            "ppl": perplexity(sum(ex["nll"] for ex in examples), tokens),
            "accuracy": sum(ex["hits"] for ex in examples) / max(tokens, 1),
        }
