"""`disagg serve`'s defaults sized to the machine it finds: what each flag the user left unset becomes,
and why, in words the ready line prints.

Pure: it takes the CPUs each role got (disagg/cpus.py's plan) and the flags as given (None: not given).
The figures behind each default are in docs/benchmarks.md ("Multi-turn chat", "Overload on the chat
load", "Defaults that pay"); docs/router.md ("disagg serve's defaults") explains them.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_DP_SIZE = 8  # past this a role's workers get several CPUs each (one model copy per worker)
WAITING_PER_WORKER = 4  # a request queued past these on 2 cores misses a 1.5 s TTFT objective anyway
# the decode's batch that keeps a step within the 60 ms ITL objective on one core with the default engine
# (gguf_float) on every CPU measured: at 8 the chat load's TPOT p50 was 92 ms on an AVX2 core and 65 ms on
# an AVX-512 Xeon core, at 4 60 and 51 ms (docs/benchmarks.md, "Defaults that pay", "Slow steps lately")
DECODE_SEQS_PER_WORKER = 4
LOCAL_PREFILL_TOKENS = 192  # a chat turn's new tokens: the decode prefills it while the prefill is busy
DECODE_PREFILL_TOKENS_PER_STEP = 24  # the decode's prompt chunk per step, beside every decoding request
# with no prefill serving each server runs as `disagg unified --max-num-seqs 8`, which served the chat load best
# (at most: the decode's pace, on by default, holds fewer where this machine's steps would miss the ITL objective)
WHOLE_SEQS_PER_WORKER = 8
# the decode's pace aims each step this far within the ITL objective: a request's TPOT averages every step it
# is in, and with steps at the objective about half the requests went over it (the chat load at 1/s: TPOT p50
# 61-63 ms with the pace at 60, 54 ms at 50; docs/benchmarks.md, "Admission by the first tokens' waits")
PACE_OF_ITL_SLO = 5 / 6


@dataclass(frozen=True)
class Sized:
    """Every sized setting's value (given or sized) and a note for each one that was sized."""

    dp_size: int
    decode_dp_size: int
    max_waiting_requests: int
    max_local_prefill_tokens: int
    decode_max_prefill_tokens_per_step: int
    decode_max_num_seqs: int
    whole_max_num_seqs: int
    itl_objective_ms: float
    ttft_objective_ms: float
    notes: tuple[str, ...]


def role_dp_size(cpus: frozenset[int] | None) -> int:
    """One worker per CPU the role runs on, at most MAX_DP_SIZE (1 where nothing is pinned)."""
    return 1 if cpus is None else max(1, min(len(cpus), MAX_DP_SIZE))


def size_to_machine(prefill_cpus: frozenset[int] | None, decode_cpus: frozenset[int] | None, *, itl_slo_ms: float,
                    ttft_slo_ms: float,
                    dp_size: int | None = None, decode_dp_size: int | None = None,
                    max_waiting_requests: int | None = None, max_local_prefill_tokens: int | None = None,
                    decode_max_prefill_tokens_per_step: int | None = None,
                    decode_max_num_seqs: int | None = None, whole_max_num_seqs: int | None = None,
                    itl_objective_ms: float | None = None, ttft_objective_ms: float | None = None) -> Sized:
    """The settings `disagg serve` runs: each given one as given, each None sized to the CPUs (the
    decode's pace: to 5/6 of the planner's ITL objective, `itl_slo_ms`, measured on the machine as it runs; the
    servers' admission by their first tokens' waits: to its TTFT objective, `ttft_slo_ms`)."""
    notes: list[str] = []
    if dp_size is None:
        dp_size, decode_dp_size = role_dp_size(prefill_cpus), decode_dp_size or role_dp_size(decode_cpus)
        notes.append(f"prefill dp {dp_size} + decode dp {decode_dp_size} (a worker per CPU of each role)")
    decode_dp_size = decode_dp_size or dp_size
    if max_waiting_requests is None:
        max_waiting_requests = WAITING_PER_WORKER * max(dp_size, decode_dp_size)
        notes.append(f"--max-waiting-requests {max_waiting_requests} ({WAITING_PER_WORKER} a worker; past them "
                     "429 at once, not a queue that misses every SLO)")
    if max_local_prefill_tokens is None:
        max_local_prefill_tokens = LOCAL_PREFILL_TOKENS
        notes.append(f"--max-local-prefill-tokens {LOCAL_PREFILL_TOKENS} (the decode prefills a short rest itself "
                     "while the prefill is busy)")
    if decode_max_prefill_tokens_per_step is None:
        decode_max_prefill_tokens_per_step = DECODE_PREFILL_TOKENS_PER_STEP
        notes.append(f"--decode-max-prefill-tokens-per-step {DECODE_PREFILL_TOKENS_PER_STEP} (that prefill in "
                     "chunks, beside every decoding request's token)")
    if decode_max_num_seqs is None:
        decode_max_num_seqs = DECODE_SEQS_PER_WORKER
        notes.append(f"--decode-max-num-seqs {decode_max_num_seqs} (the rest wait for a slot; these keep their pace "
                     "within the ITL objective)")
    if whole_max_num_seqs is None:
        whole_max_num_seqs = WHOLE_SEQS_PER_WORKER
        notes.append(f"--whole-max-num-seqs {WHOLE_SEQS_PER_WORKER} (while no prefill serves, every server "
                     "prefills its own requests as a unified one)")
    if itl_objective_ms is None:
        itl_objective_ms = round(itl_slo_ms * PACE_OF_ITL_SLO, 1)
        notes.append(f"--itl-objective-ms {itl_objective_ms:g} (the decode's pace: as many requests run at once as "
                     "its own steps, measured as it runs, keep within 5/6 of the ITL objective, so their mean "
                     "stays within it)")
    if ttft_objective_ms is None:
        ttft_objective_ms = ttft_slo_ms
        notes.append(f"--ttft-objective-ms {ttft_objective_ms:g} (429 at once while the requests answered lately "
                     "all waited past the TTFT objective for their first token and a queue stands)")
    return Sized(dp_size, decode_dp_size, max_waiting_requests, max_local_prefill_tokens,
                 decode_max_prefill_tokens_per_step, decode_max_num_seqs, whole_max_num_seqs, itl_objective_ms,
                 ttft_objective_ms, tuple(notes))
