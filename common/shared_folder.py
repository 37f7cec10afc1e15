"""Is a folder the same on every node of the job? Checked before any training.

Every rank writes its checkpoint shards (torch.distributed.checkpoint) where it sees --output_dir.
If that path is on each node's own disk (/tmp, a node-local scratch), each node keeps a part of
every checkpoint and no node can resume from one; nothing else would notice. So rank 0 writes a
file there, and the first rank of every node must see it: otherwise one line names the node.
"""
import os
import socket
import uuid
from pathlib import Path

import torch.distributed as dist

from common.errors import UserError


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
    dist.all_gather_object(blind, None if sees else f"node {os.environ.get('GROUP_RANK', '?')} "
                                                    f"({socket.gethostname()})")
    if dist.get_rank() == 0:  # every rank has looked by now
        probe.unlink(missing_ok=True)
    blind = [node for node in blind if node]
    if blind:
        raise UserError(f"{what} {path} is not shared by the job's nodes: {', '.join(blind)} cannot see the file "
                        "rank 0 wrote there (a folder on each node's own disk, such as /tmp or a local scratch?). "
                        "Each node would keep its part of every checkpoint: use a folder on a file system that "
                        "every node mounts (e.g. /scratch/$USER/...)")


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
