"""Is a folder the same on every node of the job? Checked before any training.

Every rank writes its checkpoint shards (torch.distributed.checkpoint) where it sees --output_dir.
If that path is on each node's own disk (/tmp, a node-local scratch), each node keeps a part of
every checkpoint and no node can resume from one; nothing else would notice. So rank 0 writes a
file there, and the first rank of every node must see it: otherwise one line names the node.
"""
import os
import socket
import sys
import uuid
from pathlib import Path

import torch.distributed as dist

from common.errors import UserError, say


def check_shared(path, what):
    """Refuse `path` (--output_dir, --prepared_dir) unless the first rank of every node sees the file
    rank 0 writes there. A collective: every rank calls it; nothing to check in a one-process run."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    name = [written_probe(Path(path)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    if name[0] is None:  # rank 0 cannot write there: a folder the job only reads, checked where it is read
        return
    probe = Path(path) / name[0]
    first_of_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
    sees = not first_of_node or (probe.is_file() and probe.read_text() == name[0])
    blind = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(blind, None if sees else this_node())
    finally:  # every rank has looked by now, or one has gone: the probe is not left behind
        if dist.get_rank() == 0:
            probe.unlink(missing_ok=True)
    blind = [node for node in blind if node]
    if blind:
        raise UserError(f"{what} {path} is not shared by the job's nodes: {', '.join(blind)} cannot see the file "
                        "rank 0 wrote there (a folder on each node's own disk, such as /tmp or a local scratch?). "
                        "Each node would keep its part of every checkpoint: use a folder on a file system that "
                        "every node mounts (e.g. /scratch/$USER/...)")


def this_node():
    """'node 1 (gpu017)': the node's rank in the job (torchrun's GROUP_RANK) and its host name."""
    return f"node {os.environ.get('GROUP_RANK', '?')} ({socket.gethostname()})"


def refuse_if_any_rank(problem):
    """`problem`: why this rank cannot use a folder, or None. A collective, where a node may see what the
    others do not (the folder read-only there), or one rank alone looks (rank 0 takes the lock): if any rank
    has a problem, every rank stops with exit status 2, before anything is written; the first such rank says
    it in one `error:` line (that names its node, in a job of several), and rank 0, if it is another, ends
    with the same words as a `stopped:` line."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if problem:
            raise UserError(problem)
        return
    several_nodes = dist.get_world_size() > int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, f"{this_node()}: {problem}" if problem and several_nodes else problem)
    failed = [rank for rank, said in enumerate(problems) if said]
    if not failed:
        return
    first = failed[0]
    if dist.get_rank() == 0 and first != 0:
        say(f"stopped: {problems[first]}", file=sys.stderr)
    raise UserError(problems[first], by_this_rank=dist.get_rank() == first)


def written_probe(folder):
    """The name of a file rank 0 has just written in `folder` (made if missing), with that name in it;
    None where it cannot write."""
    name = f".shared-check-{uuid.uuid4().hex}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(name)
    except OSError:
        return None
    return name
