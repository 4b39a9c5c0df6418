"""Pickling that copies each byte once: protocol 5, large buffers out of band, and in a process
that imported torch, a plain CPU tensor's storage as one out-of-band buffer read from its memory
(torch's own pickling goes through ``torch.save`` into bytes: three more copies).

Used by a function worker's return value (``procs.returns``) and by the state a worker keeps
in its agent (``relaunch.save_state``). relaunch never imports torch: the tensor path exists
only where the worker already has it. ``rebuild_tensor`` and ``rebuild_storage`` are named in
the pickles (a state persisted to disk too): their names and parameters are kept.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pickle


def pickler_class() -> type[pickle.Pickler]:
    """The standard pickler, and in a worker that imported torch, one that sends a plain CPU
    tensor's storage out of band (read from its memory, rebuilt from the frame's buffer)
    instead of through ``torch.save`` into bytes, which copies it three more times. Any other
    tensor (a subclass, a parameter, on a device, sparse, quantized, with autograd history or
    attributes) pickles as torch pickles it."""
    import pickle

    torch = sys.modules.get("torch")
    tensor_type = getattr(torch, "Tensor", None)
    if tensor_type is None:
        return pickle.Pickler

    class _Pickler(pickle.Pickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # One storage, one buffer: views of a storage share it in the launcher too.
            self._storages: dict[tuple[int, int], _StorageBytes] = {}

        def reducer_override(self, obj: Any) -> Any:
            if type(obj) is not tensor_type or not _plain_tensor(obj):
                return NotImplemented
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in self._storages:
                self._storages[key] = _StorageBytes(*key)
            return (
                rebuild_tensor,
                (
                    self._storages[key],
                    str(obj.dtype).removeprefix("torch."),
                    obj.storage_offset(),
                    tuple(obj.size()),
                    obj.stride(),
                    obj.requires_grad,
                ),
            )

    return _Pickler


def _plain_tensor(tensor: Any) -> bool:
    """A dense CPU tensor with no autograd history, no lazy bits and no attributes (what this
    torch cannot say is not one: torch pickles it)."""
    try:
        return _is_plain(tensor)
    except Exception:
        return False


def _is_plain(tensor: Any) -> bool:
    import torch

    return bool(
        tensor.device.type == "cpu"
        and tensor.layout is torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not any(getattr(tensor, "names", None) or ())
        and tensor.is_leaf
        and not getattr(tensor, "__dict__", None)
        and tensor.untyped_storage().nbytes() > 0
    )


class _StorageBytes:
    """A CPU tensor storage's memory, pickled as one out-of-band buffer (no copy here)."""

    def __init__(self, address: int, size: int) -> None:
        self.address = address
        self.size = size

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        import ctypes
        import pickle

        memory = (ctypes.c_char * self.size).from_address(self.address)
        return (rebuild_storage, (pickle.PickleBuffer(memoryview(memory).cast("B")),))


def rebuild_storage(buffer: Any) -> Any:
    """A storage over ``buffer`` (in the launcher: a part of the frame, not copied again)."""
    import torch

    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


def rebuild_tensor(
    storage: Any,
    dtype: str,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
) -> Any:
    import torch

    tensor = torch.empty(0, dtype=getattr(torch, dtype)).set_(storage, offset, size, stride)
    return tensor.requires_grad_() if requires_grad else tensor


def dump_parts(value: object) -> list[memoryview]:
    """``value`` pickled: the pickle, then its out-of-band buffers, each a view (not a copy)
    of the memory that holds it. Raises what the pickler raises."""
    import io

    buffers: list[memoryview] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        try:
            buffers.append(buffer.raw())
        except BufferError:  # not contiguous: pickled in band instead
            return True
        return False

    out = io.BytesIO()
    pickler_class()(out, protocol=5, buffer_callback=out_of_band).dump(value)
    return [out.getbuffer(), *buffers]
