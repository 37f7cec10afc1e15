"""Data at scale: does a run's memory and start-up stay flat as the number of games grows?

    python benchmark/data_scale.py                       # 3,000, 100,000 and 1,000,000 games (about 2 minutes)
    python benchmark/data_scale.py --games 3000 --steps 2 --out /tmp/data-scale   # a quick look

For each size it writes DATA/train.jsonl with that many games (the shipped Stockfish games,
repeated: the content does not matter here, the size does; nothing is downloaded), then measures
with the kit's own commands:
  prepare   `01_download/prepare.py` on the fresh data (tokenize and pack once, all cores);
  train     `03_ddp/train.py` on 2 ranks on the prepared data: the time from the start of the
            process to the end of its first optimiser step, the peak RSS per rank, and tokens/s.
Writes OUT/data_scale.md (and .json) and prints the table.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from common.arguments import DEMO_DIR, Parser
from common.errors import UserError, exit_on_user_error

REPO = Path(__file__).resolve().parents[1]
SEQ_LENGTH = 256


def write_games(games, source, path):
    """`games` lines of jsonl, cycling through the lines of `source`."""
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for i in range(games):
            out.write(lines[i % len(lines)] + "\n")


def timed(command, log, env):
    started = time.perf_counter()
    with log.open("w") as out:
        result = subprocess.run([str(c) for c in command], stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    if result.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"{command[1]} failed ({tail[0]}): see {log}")
    return time.perf_counter() - started


def measure(games, args, env):
    work = Path(args.out) / f"games-{games}"
    data, prepared, run = work / "data", work / "prepared", work / "run"
    shutil.rmtree(prepared, ignore_errors=True)  # a previous measurement's: this one prepares from scratch
    write_games(games, Path(args.demo) / "data/train.jsonl", data / "train.jsonl")
    (data / "validation.jsonl").write_text((Path(args.demo) / "data/validation.jsonl").read_text())
    model = Path(args.demo) / "model"
    prepare_s = timed([sys.executable, "01_download/prepare.py", "--model", model, "--data_dir", data,
                       "--prepared_dir", prepared, "--max_seq_length", SEQ_LENGTH], work / "prepare.log", env)
    timed([sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node", 2, "03_ddp/train.py",
           "--model", model, "--data_dir", data, "--prepared_dir", prepared, "--output_dir", run, "--overwrite",
           "--max_steps", args.steps, "--max_seq_length", SEQ_LENGTH, "--total_batch_size", 16,
           "--batch_size_per_device", 8, "--eval_every", 0, "--eval_rows", 8, "--eval_games", 8],
          work / "train.log", {**env, "OMP_NUM_THREADS": "1"})
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    # Two prepared sets, the training games' and the validation games': the figures are the former's.
    meta = next(m for m in map(json.loads, (p.read_text() for p in prepared.glob("*/meta.json")))
                if m["sources"][0].endswith("train.jsonl"))
    return {"games": games, "data_mb": round((data / "train.jsonl").stat().st_size / 1e6, 1),
            "rows": meta["rows"], "tokens": meta["tokens"], "prepare_s": round(prepare_s, 1),
            "first_step_s": records[0]["since_start_s"], "peak_rss_mib_per_rank": summary["peak_rss_mib_per_rank"],
            "tokens_per_s": summary["tokens_per_s"]}


def table(rows, header):
    lines = [header, "",
             "| games | train.jsonl MB | rows | prepare s | first optimiser step s | peak RSS MiB/rank | tokens/s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['games']:,} | {r['data_mb']} | {r['rows']:,} | {r['prepare_s']} | {r['first_step_s']} | "
              f"{r['peak_rss_mib_per_rank']} | {r['tokens_per_s']} |" for r in rows]
    if len(rows) > 1:
        small, large = rows[0], rows[-1]
        lines += ["", f"From {small['games']:,} to {large['games']:,} games: peak RSS per rank "
                      f"{large['peak_rss_mib_per_rank'] - small['peak_rss_mib_per_rank']:+.1f} MiB, first step "
                      f"{large['first_step_s'] - small['first_step_s']:+.1f} s."]
    return "\n".join(lines) + "\n"


def main():
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("games", type=int, nargs="+", default=[3000, 100_000, 1_000_000], help="sizes to measure")
    parser.add("steps", type=int, default=3, help="optimiser steps per training run")
    parser.add("demo", default=str(DEMO_DIR), help="the demo folder (01_download/download.py --demo --out demo)")
    parser.add("out", default=str(REPO / "runs" / "data_scale"), help="work folder; the table goes here too")
    args = parser.parse_args()
    if not (Path(args.demo) / "data/train.jsonl").is_file():
        raise UserError(f"no demo in {args.demo}: run `python 01_download/download.py --demo --out demo` first")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true"}
    load_before = os.getloadavg()
    rows = []
    for games in args.games:
        print(f"== {games:,} games", flush=True)
        rows.append(measure(games, args, env))
        print(f"   {rows[-1]}", flush=True)
    header = (f"Command: `python benchmark/data_scale.py {' '.join(sys.argv[1:])}` "
              f"({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPU cores; load average "
              f"{', '.join(f'{x:.2f}' for x in load_before)} before, "
              f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} after). The demo model and tokenizer (one token "
              f"per move), {SEQ_LENGTH}-token packed rows; training: 03_ddp on 2 CPU ranks, 16 rows per step, "
              f"{args.steps} steps, on the prepared data.")
    text = table(rows, header)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "data_scale.md").write_text(text)
    (Path(args.out) / "data_scale.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n" + text)


if __name__ == "__main__":
    exit_on_user_error(main)
