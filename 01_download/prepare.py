"""Step 1b: tokenize the games once, on the login node, for the model you will train.

    python 01_download/prepare.py --model demo/model --data_dir demo/data
    python 01_download/prepare.py --model codellama/CodeLlama-7b-hf --data_dir $SCRATCH/chess/data

It reads DATA_DIR/{train,validation}.jsonl (or DATA_DIR/{train,validation}/*.parquet, the files
of laion/strategic_game_chess as they are), checks every game, tokenizes with all the cores it may
use, and writes a flat token file that every rank of a training run memory-maps. The games are
written in the model's notation (the built-in model's `P e2 e4`, made by replaying each game; UCI
for CodeLlama unless --notation says otherwise). The copy is found again by content: the bytes of
the data, the tokenizer, the notation, --max_seq_length and packing. So prepare with the settings
you will train with; a run that finds no prepared copy makes one itself (one
process does, the others wait), which on a million games costs the job a minute or so.

The copy goes to $HF_DATASETS_CACHE/chess-kit (else $HF_HOME/datasets/chess-kit, else
~/.cache/huggingface/datasets/chess-kit), or to --prepared_dir: never next to the data, which may
be read-only. Give the training run the same place (--prepared_dir, or the same environment).
Running it again finds the copy and does nothing.
"""
import argparse

from common.errors import UserError, exit_on_user_error
from common.model import load_config
from common.notation import NOTATIONS, training_notation
from common.prepare_data import SPLITS, default_cache_dir, prepared_rows


def load_tokenizer(name):
    """A local model folder, or a Hugging Face id already downloaded (see download.py)."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=False)  # never runs, nor asks to run, its code
    except (OSError, ValueError, TypeError, KeyError) as err:
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise UserError(f"cannot load the tokenizer of {name} ({reason}): pass --model as a model folder or a "
                        "Hugging Face id that download.py has downloaded") from None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder or Hugging Face id: its tokenizer is used")
    parser.add_argument("--data_dir", "--data-dir", required=True,
                        help="folder with train.jsonl or train/*.parquet, and validation.jsonl or validation/")
    parser.add_argument("--max_seq_length", "--max-seq-length", type=int, default=256,
                        help="tokens per row (as in training)")
    parser.add_argument("--notation", choices=NOTATIONS, default=None,
                        help="how the games are written (as in training; default: the model's own, else uci)")
    parser.add_argument("--no_packing", "--no-packing", action="store_true",
                        help="one game per row, as training with --no_packing")
    parser.add_argument("--prepared_dir", "--cache_dir", "--cache-dir", default=None,
                        help=f"where the prepared copy goes (default: {default_cache_dir()})")
    args = parser.parse_args()
    if args.max_seq_length < 16:  # as the training scripts
        raise UserError(f"--max_seq_length must be at least 16 tokens (got {args.max_seq_length})")
    tokenizer = load_tokenizer(args.model)
    notation = training_notation(args, load_config(args.model, max_seq_length=args.max_seq_length))
    for split in SPLITS:
        rows = prepared_rows(args.data_dir, split, tokenizer, args.max_seq_length, not args.no_packing,
                             cache_dir=args.prepared_dir, notation=notation)
        if len(rows) == 0:  # training refuses it (no batch to take, no validation row): say so here, not in the job
            games = f"{rows.meta['games']:,} game{'s' if rows.meta['games'] != 1 else ''}"
            raise UserError(f"the {split} games in {args.data_dir} ({games}, "
                            f"{rows.meta['tokens']:,} tokens) make no row of {args.max_seq_length} tokens, and "
                            "training needs rows: add games, or pass a smaller --max_seq_length (or --no_packing) "
                            "here and in training")
        print(f"{split}: {len(rows):,} rows of up to {args.max_seq_length} tokens in {rows.folder}", flush=True)


if __name__ == "__main__":
    exit_on_user_error(main)
