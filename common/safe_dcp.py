"""Reading a sharded (torch.distributed.checkpoint) checkpoint without letting it run code."""
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta


# torch.distributed.checkpoint reads a checkpoint's index (.metadata) with plain pickle and its
# non-tensor entries (the optimizer's hyperparameters) with torch.load(weights_only=False): a
# checkpoint folder from someone else could run code on --resume. These two classes read the same
# files but accept only what such files are made of.
class _MetadataUnpickler(pickle.Unpickler):
    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        found = super().find_class(module, name) if module in (*self.MODULES, "torch") else None
        if isinstance(found, torch.dtype) or (module in self.MODULES and isinstance(found, type)):
            return found  # a dtype, or one of DCP's own metadata classes
        raise pickle.UnpicklingError(f"{module}.{name} has no place in a checkpoint's metadata: refused")


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):
        value = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
        else:
            self.state_dict[read_item.dest_index.fqn] = value


def safe_load(state, path, **kwargs):
    """dcp.load, reading only tensors and plain values (see SafeReader)."""
    dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), **kwargs)
