"""Does the model learn chess? The built-in model, trained on a CPU, against its legal-move rate.

    python benchmark/learn_chess.py            # the full run: about 10 minutes on 2 CPU cores
    python benchmark/learn_chess.py --quick    # the same path in a few steps (seconds): the test

It builds under --out the demo's model (01_download/download.py --demo: the same tokenizer, shape
and seeded random weights, reading games in the piece notation `P e2 e4`) and a data folder from
the games shipped in 01_download/ (chess_sample.parquet and chess_learn.parquet). --held_out
openings are held out with every game that opens alike for 10 plies (common/chess_eval.py:
held_out_split), so no training game shares a 10-ply prefix with an evaluated one. Then it trains
with 03_ddp/train.py on 2 ranks (04_fsdp/train.py with --step 4, 02_singlegpu/train.py with
--nproc 1) and --optimizer muon (Muon
for the decoder's matrices, AdamW for the rest), exactly as a user would; the
step script's own evaluation measures the legal-move rate every --eval_every steps on the first
--eval_games held-out games. At the end the final model answers one position of every held-out
game: the greedy next move, read back as a move and checked with python-chess, counted overall and
by phase of the game, beside a trigram table's move (the side to move and the last two moves: what
move statistics alone score) on the same positions.

--out must be new or empty, or hold a learning run, which only --overwrite replaces (its model,
data, run and results; anything else in --out stays): a folder with other files (a copy of demo/)
is never written into. --quick has its own default --out, and its settings give way to the options
given with it.

Into --out it writes legal_moves.png (the legal-move rate, the baseline's and the validation loss
against the tokens seen), legal_moves.md (the same as tables, with the command, the recipe and the
times) and legal_moves.json. The wall time counts everything this command does. Measured on 2
cores with AVX-512 hidden, as on an AVX2-only CPU (2026-11-29): 76.8% legal moves on the 1,000
held-out positions in 557 s, the trigram table 33.0% (benchmark/README.md has the tables).
"""
import argparse
import ast
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from common.arguments import REPO, Parser, at_least
from common.chess_eval import TrigramBaseline, answers, game_prefixes, held_out_split, phase_of
from common.errors import UserError, exit_on_user_error
from common.notation import CHECK, NOTATIONS, board_after, legal_in, model_notation
from common.run_dir import RunDir
from launch.steps import load_step

SAMPLE = REPO / "01_download" / "chess_sample.parquet"
LEARN_GAMES = REPO / "01_download" / "chess_learn.parquet"
SCRIPTS = {2: REPO / "02_singlegpu" / "train.py", 3: REPO / "03_ddp" / "train.py", 4: REPO / "04_fsdp" / "train.py"}
PHASES = ("opening", "middle", "late")
# Measured for this run's model and batch (benchmark/NOTES.md: The learning run's optimiser)
LEARNING_RATES = {"muon": 9e-3, "adamw": 3e-3}

# --quick: the whole path on a few games in a few steps; it says nothing about learning.
QUICK = {"train_games": 300, "held_out": 24, "max_steps": 6, "eval_every": 3, "eval_games": 8,
         "total_batch_size": 4, "batch_size_per_device": 2}


# --out holds a learning run when it holds this record (written first), or a train.log (older runs).
RECORD = "learn_chess.json"
# What a learning run writes into --out, all --overwrite deletes (prepared/ is a cache of the
# tokenized games by their content: kept).
OUTPUTS = ("model", "data", "run", "train.log", "legal_moves.png", "legal_moves.md", "legal_moves.json", RECORD)


def take_out_folder(args):
    """Check --out before anything is built, then (with --overwrite) delete the learning run there
    and record this one. Refused: a file; a folder with other things in it (a copy of demo/, a
    user's files), which would be written over; a learning run without --overwrite."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: name a folder (new or empty) for the learning run")
    present = sorted(path.name for path in out.iterdir()) if out.is_dir() else []
    if present and not ((out / RECORD).is_file() or (out / "train.log").is_file()):
        raise UserError(f"--out {out} is not empty and holds no learning run ({', '.join(present[:4])}"
                        f"{', ...' if len(present) > 4 else ''}): its model/, data/ and run/ would be written over; "
                        "choose a new or empty folder")
    if present and not args.overwrite:
        raise UserError(f"--out {out} holds a learning run already: pass --overwrite to replace it (its model, data, "
                        "run and results), or choose another --out")
    try:
        for name in OUTPUTS:
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        out.mkdir(parents=True, exist_ok=True)
        (out / RECORD).write_text(json.dumps({"command": shlex.join(["python", *sys.argv]),
                                              "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    except OSError as err:
        raise UserError(f"cannot write the learning run into --out {out} ({err.strerror}): choose another --out") \
            from None


def build_model(folder, seed, notation, layers, hidden):
    """The built-in model, as `download.py --demo` builds it (by default: the same tokenizer, shape
    and weights); another notation or shape to compare with."""
    download = load_step("download")
    tokenizer = download.build_word_tokenizer(notation)
    model = download.build_tiny_llama(tokenizer, seed, notation, layers, hidden)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def build_data(folder, learn_games, train_games, held_out):
    """train.jsonl and validation.jsonl (the held-out games); no training game opens like a held-out one."""
    download = load_step("download")
    games = download.games_from_parquet(SAMPLE) + (download.games_from_parquet(learn_games) if learn_games else [])
    train, validation = held_out_split(list(dict.fromkeys(games)), held_out)
    if train_games:
        train = train[:train_games]
    download.write_jsonl(train, folder / "train.jsonl")
    download.write_jsonl(validation, folder / "validation.jsonl")
    return train, validation


def train_command(args, model_dir, data_dir, run_dir):
    if args.step == 2:
        launcher = [sys.executable, str(SCRIPTS[2])]
    else:
        launcher = [sys.executable, "-m", "launch.torchrun", "--standalone", f"--nproc-per-node={args.nproc}",
                    str(SCRIPTS[args.step])]
    options = {"model": model_dir, "data_dir": data_dir, "output_dir": run_dir,
               "prepared_dir": Path(args.out) / "prepared", "total_batch_size": args.total_batch_size,
               "batch_size_per_device": args.batch_size_per_device, "max_seq_length": args.max_seq_length,
               "optimizer": args.optimizer, "learning_rate": args.learning_rate,
               "warmup_steps": max(1, args.max_steps // 20),
               "max_steps": args.max_steps, "eval_every": args.eval_every, "eval_games": args.eval_games,
               "seed": args.seed, "device": "cpu"}
    # --no_packing: one game per row, from its first move, as the evaluation shows them; packed rows
    # start mid-game and run several games together (at step 100: 7% legal moves against 16%).
    # Step 4: 8 micro-batches of one game per rank and step; --accumulate_unsharded gathers each layer
    # once per step instead of once per micro-batch, as DDP's no_sync (04_fsdp/README.md, section 3)
    unsharded = ["--accumulate_unsharded"] if args.step == 4 else []
    return launcher + [f"--{name}={value}" for name, value in options.items()] + ["--no_packing"] + unsharded


def untrained_figures(output):
    """The step script prints `untrained model: {'eval_loss': ..., 'legal_move_rate': ...}` first."""
    for line in output.splitlines():
        if line.startswith("untrained model: "):
            figures = ast.literal_eval(line.split(": ", 1)[1])
            return figures["legal_move_rate"], figures["eval_loss"]
    raise UserError("the training output has no `untrained model:` line: did the step script change?")


def curve(run_dir, untrained_rate, untrained_loss):
    """(tokens seen, seconds since training started, step, validation loss, legal-move rate) at each evaluation."""
    records = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]
    points, seen = [(0, 0.0, 0, untrained_loss, untrained_rate)], 0
    for record in records:
        seen += record["tokens"]
        if "legal_move_rate" in record:
            points.append((seen, record["since_start_s"], record["step"], record["eval_loss"],
                           record["legal_move_rate"]))
    return points


def final_evaluation(model_dir, baseline, held_out, max_seq_length, seed):
    """One position of every held-out game: is the model's greedy move legal, and the trigram
    table's? Rates overall and by phase, on the same positions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prefixes = game_prefixes(held_out, len(held_out), seed)
    notation = model_notation(model.config)
    texts = answers(model, tokenizer, notation, prefixes, 32, max_seq_length, torch.device("cpu"))
    model_legal = [legal_in(board_after(prefix), notation, text) for prefix, text in zip(prefixes, texts)]
    # A `+` first closes the position's last move, which gave no check (the prompt would hold it):
    # a wrong claim, not judged as part of the move; counted, so that the strict rate can be read too.
    wrong_check = [text.split()[:1] == [CHECK] for text in texts]
    baseline_legal = [baseline.is_legal(prefix) for prefix in prefixes]
    rows = {}
    for phase in (*PHASES, "all"):
        chosen = [i for i, prefix in enumerate(prefixes) if phase in ("all", phase_of(len(prefix)))]
        rows[phase] = {"positions": len(chosen),
                       "model": sum(model_legal[i] for i in chosen) / max(1, len(chosen)),
                       "model_strict": sum(model_legal[i] and not wrong_check[i] for i in chosen) / max(1, len(chosen)),
                       "baseline": sum(baseline_legal[i] for i in chosen) / max(1, len(chosen))}
    return rows


def plot(points, baseline, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tokens = [p[0] / 1e6 for p in points]
    figure, rate_axis = plt.subplots(figsize=(7, 4.2))
    rate_axis.plot(tokens, [100 * p[4] for p in points], "o-", color="tab:blue", label="the model")
    rate_axis.axhline(100 * baseline, color="tab:gray", linestyle="--", linewidth=1,
                      label="trigram table (move statistics)")
    rate_axis.axhline(75, color="tab:blue", linestyle=":", linewidth=1)
    rate_axis.set_xlabel("tokens seen (millions)")
    rate_axis.set_ylabel("legal greedy moves, held-out positions (%)", color="tab:blue")
    rate_axis.set_ylim(0, 100)
    rate_axis.legend(loc="center right", fontsize=8)  # clear of both curves, which end high and low
    loss_axis = rate_axis.twinx()
    loss_axis.plot(tokens, [p[3] for p in points], "s--", color="tab:orange", markersize=3)
    loss_axis.set_ylabel("validation loss", color="tab:orange")
    rate_axis.set_title(title, fontsize=9)
    rate_axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def tables(points, baseline, final, summary):
    lines = [summary, "", "| step | tokens seen | training time (s) | validation loss | legal moves | trigram table |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {step} | {seen:,} | {seconds:.0f} | {loss:.3f} | {100 * rate:.1f}% | {100 * baseline:.1f}% |"
              for seen, seconds, step, loss, rate in points]
    lines += ["", "The final model on one position of every held-out game (phase: plies played before it):", "",
              "| phase | positions | the model | the model, a wrong `+` first counted illegal | trigram table |",
              "|---|---:|---:|---:|---:|"]
    names = {"opening": "opening (< 20 plies)", "middle": "middle (20-79)", "late": "late (80 and more)",
             "all": "**all**"}
    lines += [f"| {names[phase]} | {row['positions']:,} | {100 * row['model']:.1f}% | {100 * row['model_strict']:.1f}% "
              f"| {100 * row['baseline']:.1f}% |" for phase, row in final.items()]
    return "\n".join(lines) + "\n"


def load_average():
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def parse_arguments(argv=None):
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("out", default=None, help="model, data, run and results go here: a new or empty folder, or a learning "
               "run's with --overwrite (default: runs/learn_chess, with --quick runs/learn_chess_quick)")
    parser.add("overwrite", action="store_true",
               help="replace the learning run in --out (its model, data, run and results; nothing else there)")
    parser.add("quick", action="store_true", help="a few steps on a few games (seconds); says nothing about learning; "
               "its settings give way to the options given with it")
    parser.add("nproc", type=int, choices=[1, 2], default=2,
               help="2: 03_ddp/train.py on 2 ranks (or --step 4's); 1: 02_singlegpu/train.py")
    parser.add("step", type=int, choices=sorted(SCRIPTS), default=None,
               help="the step script that trains: 3 (DDP) or 4 (FSDP, FULL_SHARD) on 2 ranks, 2 on one process "
                    "(default: 3, or 2 with --nproc 1)")
    parser.add("notation", choices=NOTATIONS, default="piece", help="how the games are written (common/notation.py)")
    parser.add("layers", type=at_least(1), default=8, help="decoder layers of the model")
    parser.add("hidden", type=at_least(8), default=128, help="hidden size of the model: a multiple of 8 (4 heads of an "
               "even size, as rotary positions need)")
    parser.add("learn_games", default=str(LEARN_GAMES), help="games added to the sample's ('' for none)")
    parser.add("train_games", type=at_least(0), default=0, help="train on the first N games only (0: all)")
    parser.add("held_out", type=at_least(1), default=1000, help="openings held out for the evaluation")
    parser.add("total_batch_size", type=at_least(1), default=16, help="rows per optimiser step")
    parser.add("batch_size_per_device", type=at_least(1), default=1,
               help="rows per forward pass; a pass pads its rows to the longest game, so fewer rows waste less")
    parser.add("max_seq_length", type=at_least(16), default=1024, help="tokens per row: whole games of up to 300 plies")
    parser.add("optimizer", choices=list(LEARNING_RATES), default="muon",
               help="muon: Muon for the decoder's matrices, AdamW for the rest (it learns the board in about "
                    "half the tokens, benchmark/NOTES.md); adamw: AdamW alone, the steps' default")
    parser.add("learning_rate", type=float, default=None,
               help="peak learning rate, cosine decay to 10%% (default: each optimizer's best measured, "
                    + ", ".join(f"{name} {rate:g}" for name, rate in LEARNING_RATES.items()) + ")")
    parser.add("max_steps", type=at_least(1), default=800)
    parser.add("eval_every", type=at_least(0), default=200)
    parser.add("eval_games", type=at_least(1), default=200, help="held-out positions for the curve (during training)")
    parser.add("seed", type=at_least(0), default=0, help="the model's initialisation, the data order and the positions")
    args = parser.parse_args(argv)
    if args.quick:  # QUICK's values are its defaults: argparse fills in only what the namespace lacks
        args = parser.parse_args(argv, argparse.Namespace(**QUICK))
    if args.out is None:
        args.out = str(REPO / "runs" / ("learn_chess_quick" if args.quick else "learn_chess"))
    if args.learning_rate is None:
        args.learning_rate = LEARNING_RATES[args.optimizer]
    if args.hidden % 8:
        raise UserError(f"--hidden {args.hidden}: the model's 4 heads need a hidden size that is a multiple of 8 "
                        f"(each head an even size, for rotary positions): e.g. --hidden {args.hidden // 8 * 8 or 8}")
    if args.learn_games and Path(args.learn_games).is_dir():
        raise UserError(f"--learn_games {args.learn_games} is a folder: it takes a Parquet file of games, as "
                        "01_download/chess_learn.parquet (or '' for none)")
    if args.step is None:
        args.step = 2 if args.nproc == 1 else 3
    if (args.step == 2) != (args.nproc == 1):
        raise UserError(f"--step {args.step} with --nproc {args.nproc}: step 2 trains in one process (--nproc 1), "
                        "steps 3 and 4 on 2 ranks (--nproc 2)")
    if args.learn_games and not Path(args.learn_games).is_file():
        raise UserError(f"{args.learn_games} does not exist: it ships with the repo (make it again with the command "
                        "in 01_download/make_chess_sample.py's docstring), or pass --learn_games ''")
    if args.held_out < max(args.eval_games, 1):
        raise UserError(f"--held_out {args.held_out} is fewer than --eval_games {args.eval_games}: hold out more")
    return args


def main():
    args = parse_arguments()
    began, load_before = time.time(), load_average()
    take_out_folder(args)
    out = Path(args.out)
    model_dir, data_dir, run_dir = out / "model", out / "data", out / "run"
    parameters = build_model(model_dir, args.seed, args.notation, args.layers, args.hidden)
    train, held_out = build_data(data_dir, args.learn_games, args.train_games, args.held_out)
    train_moves = sum(len(game.split()) for game in train)
    print(f"model: a {args.layers} x {args.hidden} Llama of {parameters / 1e6:.2f}M parameters, {args.notation} "
          f"notation, in {model_dir}\n"
          f"data: {len(train):,} training games ({train_moves:,} moves), {len(held_out):,} held-out games "
          f"in {data_dir}", flush=True)

    command = train_command(args, model_dir, data_dir, run_dir)
    threads = max(1, len(os.sched_getaffinity(0)) // args.nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    print("$ " + shlex.join(command), flush=True)
    lines = []
    with subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as training, (out / "train.log").open("w") as log:
        for line in training.stdout:  # the evaluations as they come; everything into train.log
            log.write(line)
            shown = line.rstrip("\n").split("\r")[-1]  # a line written while the bar is drawn follows it
            lines.append(shown)
            if shown.startswith(("step ", "untrained", "prepared")):
                print("  " + shown.rstrip(), flush=True)
    if training.returncode != 0:
        raise UserError(f"training failed (exit status {training.returncode}); its last lines (all in "
                        f"{out / 'train.log'}):\n" + "\n".join(lines[-15:]))
    trained_s = time.time() - began

    points = curve(run_dir, *untrained_figures("\n".join(lines)))
    curve_positions = game_prefixes(held_out[: args.eval_games], args.eval_games, args.seed)  # the step script's
    baseline = TrigramBaseline(train)
    curve_baseline = sum(map(baseline.is_legal, curve_positions)) / len(curve_positions)
    print(f"evaluating the final model on {len(held_out):,} held-out positions ...", flush=True)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    final = final_evaluation(RunDir(run_dir).final, baseline, held_out, args.max_seq_length, args.seed)
    wall_s = time.time() - began
    # CPU seconds of this command and all it ran: on a shared machine the wall time also
    # says how busy the neighbours were
    cpu_s = sum(usage.ru_utime + usage.ru_stime
                for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
    load = f"{load_before} before, {load_average()} after"
    invocation = shlex.join(["python", os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
    every = final["all"]
    summary = (f"`{invocation}`: a {args.layers} x {args.hidden} Llama of {parameters / 1e6:.2f}M parameters in "
               f"the {args.notation} notation; "
               f"{len(train):,} training games ({train_moves:,} moves), {len(held_out):,} held out; {args.max_steps} "
               f"steps of {args.total_batch_size} games (rows of up to {args.max_seq_length} tokens), "
               f"{args.optimizer} at a peak learning rate of {args.learning_rate:g}; "
               f"{SCRIPTS[args.step].relative_to(REPO)} on {args.nproc} "
               f"process{'es' if args.nproc > 1 else ''} x {threads} "
               f"thread{'s' if threads > 1 else ''}. Legal greedy moves on {every['positions']:,} held-out positions: "
               f"{100 * every['model']:.1f}% after {points[-1][0]:,} tokens ({100 * every['model_strict']:.1f}% with "
               f"a wrong `+` first counted illegal; trigram table {100 * every['baseline']:.1f}%). Wall time "
               f"{wall_s:.0f} s for everything, {trained_s:.0f} s to the "
               f"trained model (CPU time {cpu_s:.0f} s); load average {load}.")
    plot(points, curve_baseline, out / "legal_moves.png", f"{parameters / 1e6:.1f}M model, {len(train):,} "
         f"games: {100 * every['model']:.0f}% legal after {wall_s / 60:.1f} min on the CPU")
    (out / "legal_moves.md").write_text(tables(points, curve_baseline, final, summary))
    (out / "legal_moves.json").write_text(json.dumps(
        {"legal_move_rate": every["model"], "baseline": every["baseline"], "by_phase": final,
         "legal_move_rate_untrained": points[0][4], "wall_s": round(wall_s, 1), "trained_s": round(trained_s, 1),
         "cpu_s": round(cpu_s, 1), "load_average": load, "command": invocation,
         "data": {"train_games": len(train), "train_moves": train_moves, "held_out_games": len(held_out)},
         "points": [dict(zip(("tokens", "seconds", "step", "eval_loss", "legal_move_rate"), p)) for p in points]},
        indent=1) + "\n")
    phases = ", ".join(f"{phase} {100 * final[phase]['model']:.1f}% (table {100 * final[phase]['baseline']:.1f}%)"
                       for phase in PHASES)
    print(f"\nlegal moves on {every['positions']:,} held-out positions: {100 * every['model']:.1f}% "
          f"({100 * every['model_strict']:.1f}% with a wrong `+` first counted illegal; trigram table "
          f"{100 * every['baseline']:.1f}%); {phases}\nwall time: {wall_s:.0f} s (CPU time {cpu_s:.0f} s; load "
          f"average {load})\nplot: {out / 'legal_moves.png'}\ntable: {out / 'legal_moves.md'}", flush=True)


if __name__ == "__main__":
    exit_on_user_error(main)
