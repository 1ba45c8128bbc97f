"""Per-expert weights as one [E, ...] stack: finding the stack a list of tensors is, and making one.

Why: the fused op runs on stacked weights. A list that is `unbind` of a stacked parameter already is one;
the separate tensors of a ModuleList of Linears are moved once into one allocation (`restack`).

What a stack may hold on to: the memory, never the tensors it was found from. `stacked_view` returns a
tensor set on the storage itself (no `_base`), so a cached stack does not keep a deleted model's
parameters alive; the caller that caches it drops it when they die (weight_stacks.py).

What saving sees: a moved tensor gets a storage of its own that aliases its slice of the stack's memory
(`UntypedStorage` slicing), so `torch.save` of one expert writes that expert alone and safetensors sees
tensors that share no storage. The stack's storage lives as long as any slice; a weak registry lets
`stacked_view` find it again from the slices' addresses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# {address of a stack `restack` made: weak reference to its storage}
_MADE: dict[int, StorageWeakRef] = {}


def stacked_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The [E, ...] tensor that `tensors` are consecutive equal-stride slices of, or None.

    Addresses first (an integer each), then one metadata comparison per tensor. The view is set on a
    storage that holds every slice (the first tensor's, or the stack `restack` made), and torch checks
    its bounds, so tensors that merely lie evenly spaced in memory are never read as one.
    """
    first = tensors[0]
    pointers = [t.data_ptr() for t in tensors]
    size = first.element_size()
    step = pointers[1] - pointers[0] if len(tensors) > 1 else first.numel() * size
    if step <= 0 or step % size or pointers != list(range(pointers[0], pointers[-1] + 1, step)):
        return None
    shape, strides, dtype = first.shape, first.stride(), first.dtype
    if not all(t.shape == shape and t.stride() == strides and t.dtype == dtype for t in tensors):
        return None
    sizes, strides = (len(tensors), *shape), (step // size, *strides)
    for storage in (first.untyped_storage(), _made_storage(pointers[0])):
        if storage is None:
            continue
        offset, remainder = divmod(pointers[0] - storage.data_ptr(), size)
        # `set_` would grow a storage too small for the view (moving its data): check the bounds first
        if offset < 0 or remainder or not _within(storage, offset, sizes, strides, size):
            continue
        return torch.empty(0, dtype=dtype, device=first.device).set_(storage, offset, sizes, strides)
    return None


def _within(storage: torch.UntypedStorage, offset: int, sizes, strides, element_size: int) -> bool:
    """Every element of the strided view lies inside `storage`."""
    if any(s < 0 for s in strides):
        return False
    last = offset + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True) if n > 0)
    return (last + 1) * element_size <= storage.nbytes()


def _made_storage(address: int) -> torch.UntypedStorage | None:
    """The storage of a live stack `restack` made at `address`, or None."""
    ref = _MADE.get(address)
    if ref is None or ref.expired():
        return None
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata)


def _sole_owner(tensor: torch.Tensor) -> bool:
    """The tensor covers its whole storage and no other tensor shares that storage."""
    storage = tensor.untyped_storage()
    return (
        tensor.storage_offset() == 0
        and storage.nbytes() == tensor.numel() * tensor.element_size()
        and torch._C._storage_Use_Count(storage._cdata) == 2  # the tensor and `storage` here
    )


def movable(tensors: list) -> bool:
    """Whether these per-expert tensors may be moved into one stack: plain tensors or Parameters (no
    subclass), contiguous, each the sole user of its own storage (no view of it elsewhere would keep the
    old data), distinct, of one shape, dtype and device, and not one stack already."""
    if len(tensors) < 2 or not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return False
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for t in tensors):
        return False
    if len({t.data_ptr() for t in tensors}) != len(tensors) or stacked_view(tensors) is not None:
        return False
    return all(t.is_contiguous() and t._base is None and _sole_owner(t) for t in tensors)


def restack(tensors: list[torch.Tensor]) -> None:
    """Move the tensors' data into one new [E, ...] allocation; each tensor gets a storage of its own
    over its slice of it (saved alone, see the module docstring)."""
    with torch.no_grad():
        stack = torch.stack([t.detach() for t in tensors])
        storage, nbytes = stack.untyped_storage(), stack[0].nbytes
        for index, tensor in enumerate(tensors):
            piece = storage[index * nbytes : (index + 1) * nbytes]
            tensor.data = torch.empty(0, dtype=stack.dtype, device=stack.device).set_(
                piece, 0, stack.shape[1:], stack.stride()[1:]
            )
    for address in [a for a, ref in _MADE.items() if ref.expired()]:
        del _MADE[address]
    _MADE[storage.data_ptr()] = StorageWeakRef(storage)


def unstack(tensors: list[torch.Tensor]) -> None:
    """Give each tensor its own allocation again (undoes `restack` where a compile must see the inputs as
    dynamo recorded them)."""
    with torch.no_grad():
        for tensor in tensors:
            tensor.data = tensor.detach().clone()
