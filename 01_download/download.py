"""Step 1: get the model and the chess games onto the cluster's shared disk.

Compute nodes usually have no internet, so this runs once on a login node:

    python 01_download/download.py --out $SCRATCH/chess            # CodeLlama-7b + 100k games
    python 01_download/download.py --demo --out demo               # tiny built-in default, no network

The real path puts the model and the dataset's parquet files in the Hugging Face cache (HF_HOME,
or --cache_dir) and uses the files where they are: OUT/data/train/ links to them (the last one
cut to the number of games asked for), and the held-out games follow in OUT/data/validation.jsonl.
Millions of games are never rewritten as text; 01_download/prepare.py (or the first training
run) tokenizes them once. Running it again downloads nothing. The demo builds a tiny Llama that
reads games in the piece notation (`P e2 e4`: common/notation.py) and writes the chess sample
shipped with the repo (made by make_chess_sample.py) as OUT/data/{train,validation}.jsonl, one
{"text": "e2e4 e7e5 ..."} per game: the data stays UCI, the notation is made when it is prepared.
OUT/data/demo.json records what it wrote: run again, it replaces those files only, and refuses an
OUT whose model/ or data/ holds anything else (your own model or games stay as they are).
"""
import argparse
import contextlib
import hashlib
import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from common.chess_eval import held_out_split
from common.errors import UserError, exit_on_user_error
from common.notation import CONFIG_KEY as NOTATION_KEY
from common.notation import vocabulary

HERE = Path(__file__).resolve().parent
SHIPPED_SAMPLE = HERE / "chess_sample.parquet"
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model"]  # config, weights, tokenizer: nothing else
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>"]


# ---- writing games ---------------------------------------------------------------------------------

def games_from_parquet(path):
    """The `Moves` column (a list of UCI strings per game) as space-separated text."""
    try:
        table = pq.read_table(path, columns=["Moves"])
    except Exception as err:  # pyarrow raises several types for damaged or foreign files
        raise UserError(f"{path}: not a chess parquet file with a Moves column ({err})") from None
    return [" ".join(moves) for moves in table.column("Moves").to_pylist() if moves]


def write_atomically(path, lines):
    """Written to a temporary name first, so an interrupted run never leaves half a file."""
    partial = path.with_suffix(".partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with partial.open("w", encoding="utf-8") as out:
            out.writelines(lines)
        os.replace(partial, path)
    except OSError as err:
        raise UserError(f"cannot write {path} ({err.strerror}): check the --out directory and the free space") from None


def write_jsonl(games, path):
    write_atomically(path, (json.dumps({"text": game}) + "\n" for game in games))


def write_splits(games, data_dir, validation_games):
    """The last `validation_games` openings are held out, with every game that opens alike; the rest
    are for training (common/chess_eval.py: held_out_split)."""
    if len(games) <= validation_games:
        raise UserError(f"only {len(games)} games, but {validation_games} are to be held out for validation")
    train, validation = held_out_split(games, validation_games)
    write_jsonl(train, data_dir / "train.jsonl")
    write_jsonl(validation, data_dir / "validation.jsonl")
    return {"train_games": len(train), "validation_games": len(validation)}


# ---- the real download (login node, internet) ---------------------------------------------------

@contextlib.contextmanager
def hub_errors(kind, repo_id):
    """The hub's answers a user can act on, as one line instead of a traceback."""
    import httpx2  # huggingface_hub's own HTTP client (not httpx, which requirements.txt does not bring)
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)
    try:
        yield
    except GatedRepoError:
        raise UserError(f"the {kind} {repo_id} is gated: accept its conditions on its hub page, then set HF_TOKEN "
                        "to a token of that account (huggingface.co/settings/tokens)") from None
    except RepositoryNotFoundError:
        raise UserError(f"no {kind} {repo_id} on {constants.ENDPOINT}: check the spelling (--{kind} "
                        "org/name, e.g. codellama/CodeLlama-7b-hf); a private one also needs HF_TOKEN") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, httpx2.TransportError) as err:  # refused, or unreachable
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise UserError(f"cannot download the {kind} {repo_id} from {constants.ENDPOINT} ({reason}): run this "
                        "on a machine with internet (a login node), or check HF_ENDPOINT and proxies") from None


def download_model(repo_id, cache_dir):
    """The model snapshot in the Hugging Face cache. A complete cached copy is used as is."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES, cache_dir=cache_dir,
                                      local_files_only=True))
    except LocalEntryNotFoundError:
        print(f"downloading {repo_id} (config, safetensors weights, tokenizer) ...", flush=True)
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES, cache_dir=cache_dir))


def parquet_games(path):
    """The number of games in a parquet file (from its footer: nothing else is read)."""
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for damaged or foreign files
        raise UserError(f"{path}: not a parquet file ({err})") from None
    if "Moves" not in parquet.schema_arrow.names:
        raise UserError(f"{path}: not a chess parquet file with a Moves column (it has "
                        f"{', '.join(parquet.schema_arrow.names)})")
    return parquet.metadata.num_rows


def rows_of(path, start, count):
    """Rows start .. start+count-1 of a parquet file, reading only the batches that hold them."""
    import pyarrow as pa
    batches, seen = [], 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=65536):
        first, end = max(start, seen), min(start + count, seen + batch.num_rows)
        if first < end:
            batches.append(batch.slice(first - seen, end - first))
        seen += batch.num_rows
        if seen >= start + count:
            break
    return pa.Table.from_batches(batches)


def download_games(repo_id, games_wanted, cache_dir):
    """The dataset's parquet files, in name order, until they hold enough games: (paths in the
    cache, games in each)."""
    from huggingface_hub import HfApi, hf_hub_download
    names = sorted(name for name in HfApi().list_repo_files(repo_id, repo_type="dataset")
                   if name.endswith(".parquet"))
    if not names:
        raise UserError(f"{repo_id} has no parquet files")
    paths, counts = [], []
    for name in names:
        paths.append(Path(hf_hub_download(repo_id, name, repo_type="dataset", cache_dir=cache_dir)))
        counts.append(parquet_games(paths[-1]))
        if sum(counts) >= games_wanted:
            break
    else:
        print(f"note: {repo_id} holds only {sum(counts)} games", flush=True)
    return paths, counts


def link_games(paths, counts, train_games, validation_games, data_dir):
    """data_dir/train/ links to the cached files that hold the first `train_games` games (the last
    file, cut to size, is written as a parquet file of its own); data_dir/validation.jsonl has the
    next `validation_games`. The new train/ is built under a name of this process, moved in last."""
    partial = data_dir / f"train.partial-{os.getpid()}"
    try:
        partial.mkdir(parents=True)
        held_out, start = [], 0
        for path, count in zip(paths, counts):
            if start + count <= train_games:
                (partial / path.name).symlink_to(path)  # the cached file itself, as it is
            elif start < train_games:
                pq.write_table(rows_of(path, 0, train_games - start),
                               partial / f"{path.stem}.first-{train_games - start}.parquet")
            if start + count > train_games and len(held_out) < validation_games:
                table = rows_of(path, max(0, train_games - start), validation_games - len(held_out))
                held_out += [" ".join(moves) for moves in table.column("Moves").to_pylist()]
            start += count
        write_jsonl(held_out, data_dir / "validation.jsonl")
    except (OSError, UserError) as err:
        shutil.rmtree(partial, ignore_errors=True)  # ours; the earlier train/ stays as it was
        if isinstance(err, UserError):
            raise
        raise UserError(f"cannot write {partial} ({err.strerror}): check the --out directory and the free space") \
            from None
    shutil.rmtree(data_dir / "train", ignore_errors=True)  # an earlier download's (download.json said so)
    os.replace(partial, data_dir / "train")


def download(args):
    out = Path(args.out)
    data_dir = out / "data"
    wanted = {"dataset": args.dataset, "games": args.games, "validation_games": args.validation_games}
    # download.json says which request the games in data/ answer. It is written last, and emptied
    # before they are rewritten: an interrupted run then leaves no manifest that could vouch for the
    # games of a different request. Games without a download.json are not this step's: they are
    # never replaced.
    manifest_path = data_dir / "download.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    if manifest is None and any((data_dir / name).exists() for name in ("train", "train.jsonl", "validation.jsonl")):
        raise UserError(f"{data_dir} holds games this step did not download (no download.json): choose another "
                        "--out")
    with hub_errors("model", args.model):
        model_dir = download_model(args.model, args.cache_dir)
    splits_there = (data_dir / "train").is_dir() and (data_dir / "validation.jsonl").is_file()
    if splits_there and manifest and manifest.get("request") == wanted:
        print(f"games already in {data_dir}", flush=True)
    else:
        print(f"downloading {args.games} games of {args.dataset} ...", flush=True)
        with hub_errors("dataset", args.dataset):
            paths, counts = download_games(args.dataset, args.games, args.cache_dir)
        games = min(args.games, sum(counts))
        if games <= args.validation_games:
            raise UserError(f"only {games} games, but {args.validation_games} are to be held out for validation")
        # Still this step's games, but they no longer answer any request until the new ones are in.
        write_atomically(manifest_path, [json.dumps({"request": None, "note": "being replaced"}) + "\n"])
        link_games(paths, counts, games - args.validation_games, args.validation_games, data_dir)
        write_atomically(manifest_path, [json.dumps({"request": wanted, "train_games": games - args.validation_games,
                                                     "validation_games": args.validation_games}, indent=1)])
    if args.cache_dir:  # the hub cache itself (models--*/ inside): HF_HUB_CACHE names that, HF_HOME the folder above
        cache = "HF_HUB_CACHE=" + shlex.quote(str(Path(args.cache_dir).expanduser().resolve()))
    else:
        cache = "HF_HOME=" + shlex.quote(os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")))
    print(f"\nmodel: {model_dir}\ndata:  {data_dir}\n"
          "On compute nodes (no internet) set, before Python starts:\n"
          f"  export {cache}   # the same cache this step filled\n"
          "  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1\n"
          f"and train with --model {args.model} --data_dir {data_dir}\n"
          "Tokenize the games once, here, before the first job (else its first process does it):\n"
          f"  python 01_download/prepare.py --model {args.model} --data_dir {data_dir}", flush=True)


# ---- the built-in tiny default (no network) -----------------------------------------------------

def build_word_tokenizer(notation="piece"):
    """One token per word of the notation (common/notation.py). The built-in one reads the piece
    notation: 6 pieces, 64 squares and 4 promotions, and `N g1 f3` is three tokens, so the model
    must know where the pieces are. In UCI a move is one token (benchmark/learn_chess.py compares)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + vocabulary(notation))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def build_tiny_llama(tokenizer, seed, notation="piece", layers=8, hidden=128):
    """The CodeLlama architecture (LlamaForCausalLM), shrunk to 1.6M parameters: deep and narrow
    (8 layers of 128) learns the board fastest per CPU-second (the README's table). Its context
    holds a whole game of 300 plies in the piece notation. config.json names the notation."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    # Embedding rows rounded up to a multiple of 64, as real vocabularies are: 85 tokens would shard
    # unevenly over 2, 4 or 8 ranks, and the plan check counts even shards.
    config = LlamaConfig(vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=hidden,
                         intermediate_size=round(hidden * 2.6875),
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    setattr(config, NOTATION_KEY, notation)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


# The demo's record of what it wrote, OUT/data/demo.json: {"files": {path under OUT: [sha256, ...]}}.
# Only files it names (with that content), or the very bytes this run writes, are the demo's to replace.
DEMO_RECORD, DEMO_WRITER = "data/demo.json", "01_download/download.py --demo"
DEMO_RECORD_PARTIAL = "data/demo.partial"  # write_atomically's name for it while it is written


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def demo_record(out):
    """What an earlier --demo wrote under OUT, by its record: ({path: [sha256, ...]}, whether it was
    interrupted while writing them); ({}, False) where there is no record of its own."""
    try:
        record = json.loads((out / DEMO_RECORD).read_text())
        if record.get("written_by") == DEMO_WRITER and isinstance(record.get("files"), dict):
            return record["files"], bool(record.get("being_written"))
    except (OSError, ValueError, AttributeError):  # none, unreadable, or not the demo's
        pass
    return {}, False


def files_under(out):
    """What OUT/model and OUT/data hold, as paths under OUT: (plain files, anything else). A link,
    even to the demo's own files, is never the demo's."""
    files, others = [], []
    for top in (out / "model", out / "data"):
        if top.is_symlink() or (top.exists() and not top.is_dir()):
            others.append(top.name)
            continue
        if not top.is_dir():
            continue
        for folder, folders, names in os.walk(top, onerror=raise_error):
            for name in folders + names:
                path = Path(folder) / name
                where = path.relative_to(out).as_posix()
                if path.is_symlink() or not (path.is_file() or path.is_dir()):
                    others.append(where)
                elif path.is_file():
                    files.append(where)
    return files, others


def raise_error(err):
    raise err


def refuse_files_not_the_demos(out, new):
    """Nothing in OUT/model or OUT/data that the demo did not write is replaced: its record names
    it, or it holds the bytes this run would write anyway (a demo made before the record existed)."""
    recorded, interrupted = demo_record(out)

    def the_demos(name):
        if name == DEMO_RECORD_PARTIAL:  # the record, half written
            return True
        if name == DEMO_RECORD:
            return bool(recorded)
        if name in recorded and interrupted:  # a write that was cut short: any content
            return True
        if name not in recorded and name not in new:  # a name the demo never wrote: not read at all
            return False
        content = digest(out / name)
        return content in recorded.get(name, []) or content == new.get(name)

    try:
        files, others = files_under(out)
        theirs = others + [name for name in files if not the_demos(name)]
    except OSError as err:
        raise UserError(f"cannot read {err.filename} ({err.strerror}): check the --out directory") from None
    if theirs:
        named = ", ".join(theirs[:3]) + (f" and {len(theirs) - 3} more" if len(theirs) > 3 else "")
        raise UserError(f"{out} holds files that download.py --demo did not write ({named}): they stay; write the "
                        "demo to another --out (e.g. --out demo), or move them away first")
    return recorded


def write_demo(staging, out, new, recorded):
    """The staged files into OUT, each under a temporary name first. The record, written before and
    after, says which files are the demo's, so an interrupted run leaves none that a later one
    cannot tell from the user's."""
    stale = [name for name in recorded if name not in new and name not in (DEMO_RECORD, DEMO_RECORD_PARTIAL)]
    partial = {name: f"{name}.partial" for name in new}

    def record(files, being_written):
        write_atomically(out / DEMO_RECORD, [json.dumps({"written_by": DEMO_WRITER, "being_written": being_written,
                                                         "files": files}, indent=1) + "\n"])

    try:
        for folder in ("model", "data"):
            (out / folder).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create {err.filename} ({err.strerror}): --out must be a folder you may write in; "
                        "choose another --out") from None
    record({**{name: recorded[name] for name in stale}, **{name: [] for name in partial.values()},
            **{name: sorted(set(recorded.get(name, [])) | {new[name]}) for name in new}}, being_written=True)
    try:
        for name in new:
            shutil.copyfile(staging / name, out / partial[name])
            os.replace(out / partial[name], out / name)
        for name in stale:  # the demo's own, from an earlier version that wrote more
            (out / name).unlink(missing_ok=True)
    except OSError as err:
        raise UserError(f"cannot write {err.filename or out} ({err.strerror}): check the --out directory and the free "
                        "space") from None
    record({name: [new[name]] for name in new}, being_written=False)


def build_demo(args):
    out = Path(args.out)
    if (out / "data" / "download.json").is_file():  # checked before anything is built or written
        raise UserError(f"{out / 'data'} holds a real download (download.json): its games stay; write the demo "
                        "to another --out (e.g. --out demo)")
    tokenizer = build_word_tokenizer()
    model = build_tiny_llama(tokenizer, args.seed)
    games = games_from_parquet(SHIPPED_SAMPLE)
    # Built in a staging folder first: OUT is only written once it is sure nothing there is the user's.
    try:
        staging_dir = tempfile.TemporaryDirectory(prefix="kit-demo-")
    except OSError as err:
        raise UserError(f"cannot make a temporary folder ({err.strerror}): set TMPDIR to a writable one") from None
    with staging_dir as staging:
        staging = Path(staging)
        try:
            model.save_pretrained(staging / "model", safe_serialization=True)
            tokenizer.save_pretrained(staging / "model")
        except OSError as err:
            raise UserError(f"cannot write the demo model to a temporary folder, {staging} ({err.strerror}): free "
                            "some space there, or set TMPDIR to another folder") from None
        counts = write_splits(games, staging / "data", args.validation_games)
        new = {path.relative_to(staging).as_posix(): digest(path) for path in sorted(staging.rglob("*"))
               if path.is_file()}
        recorded = refuse_files_not_the_demos(out, new)
        write_demo(staging, out, new, recorded)
    params = sum(p.numel() for p in model.parameters())
    print(f"demo model ({params / 1e6:.1f}M parameters, {len(tokenizer)} tokens): {out / 'model'}\n"
          f"demo data ({counts['train_games']} train / {counts['validation_games']} validation games): "
          f"{out / 'data'}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, help="data goes to OUT/data (and the demo model to OUT/model)")
    parser.add_argument("--demo", action="store_true", help="build the tiny built-in default; no network")
    parser.add_argument("--model", default="codellama/CodeLlama-7b-hf", help="Hugging Face model id")
    parser.add_argument("--dataset", default="laion/strategic_game_chess", help="Hugging Face dataset id")
    parser.add_argument("--games", type=int, default=100_000, help="games to download")
    parser.add_argument("--validation_games", "--validation-games", type=int, default=200,
                        help="games held out for validation")
    parser.add_argument("--cache_dir", "--cache-dir", default=None,
                        help="Hugging Face cache (default: $HF_HOME/hub)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation of the demo model")
    args = parser.parse_args()
    if args.games < 1 or args.validation_games < 1:
        raise UserError("--games and --validation_games must be at least 1")
    if not args.demo and args.validation_games >= args.games:  # say so before a many-GB download, not after
        raise UserError(f"--validation_games {args.validation_games} holds out all {args.games} games of --games: "
                        "none are left for training")
    build_demo(args) if args.demo else download(args)


if __name__ == "__main__":
    exit_on_user_error(main)
