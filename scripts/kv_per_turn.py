"""The KV bytes each chat turn moved to the decode, against the KV of that turn's new tokens.

    python scripts/kv_per_turn.py --log cluster.log --report bench-out/chat_pd.json --bytes-per-token 46080

`--log` is the output of `disagg serve --log-format json` during a `disagg bench serve --workload chat`
run (the bench names each request `chat-<conversation>-<turn>-<tag>` in X-Request-Id; the decode logs
`kv received` with its `kv_bytes`). A turn's new tokens are its prompt tokens minus the previous
turn's prompt and output tokens (the decode holds those); a turn with no `kv received` line was
prefilled by the decode itself (0 bytes moved). `--bytes-per-token` is the model's KV per token:
layers x 2 x KV heads x head dim x the KV dtype's bytes (SmolLM2-135M in float32: 30 x 2 x 3 x 64 x 4).
"""

from __future__ import annotations

import argparse
import json
import statistics


def kv_bytes_by_turn(log_path: str) -> dict[tuple[int, int], int]:
    moved: dict[tuple[int, int], int] = {}
    with open(log_path, errors="replace") as log:
        for line in log:
            start = line.find("{")
            try:
                event = json.loads(line[start:]) if start >= 0 else {}
            except json.JSONDecodeError:
                continue
            request_id = str(event.get("request_id", ""))
            if event.get("event") == "kv received" and request_id.startswith("chat-"):
                _, conversation, turn, _ = request_id.split("-", 3)
                moved[int(conversation), int(turn)] = int(event["kv_bytes"])
    return moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--bytes-per-token", type=int, required=True)
    args = parser.parse_args()
    per = json.load(open(args.report))["per_request"]
    moved = kv_bytes_by_turn(args.log)
    turns = {(c, t): (p, o) for c, t, p, o, ok in zip(per["conversation_id"], per["turn_index"], per["num_prompt_tokens"],
                                                      per["num_output_tokens"], per["ok"]) if ok}
    ratios, local, remote_bytes, ideal_bytes = [], 0, 0, 0
    for (c, t), (prompt, _) in sorted(turns.items()):
        if t == 0 or (c, t - 1) not in turns:
            continue
        previous_prompt, previous_output = turns[c, t - 1]
        new_tokens = prompt - previous_prompt - previous_output
        if (c, t) not in moved:
            local += 1
            continue
        ratios.append(moved[c, t] / (new_tokens * args.bytes_per_token))
        remote_bytes += moved[c, t]
        ideal_bytes += new_tokens * args.bytes_per_token
    print(f"later turns: {len(ratios) + local} ({local} prefilled by the decode itself, {len(ratios)} with KV moved)")
    if ratios:
        print(f"KV moved / KV of the new tokens, turns with KV moved: total {remote_bytes / ideal_bytes:.3f}, "
              f"median {statistics.median(ratios):.3f}, max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
