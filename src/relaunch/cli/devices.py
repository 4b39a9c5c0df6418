"""``--nproc-per-node``'s text as a ``DeviceRequest``: a number of workers, or one per CPU or
GPU, or one per listed GPU."""

from __future__ import annotations

from relaunch.core.defaults import MAX_NPROC_PER_NODE
from relaunch.core.value import Value


class DeviceRequest(Value):
    """``--nproc-per-node``, read: ``number`` workers, or one per CPU or GPU (``per``: ``cpu``,
    ``gpu``, or ``auto`` for one per GPU if there are any, else one per CPU), or one per GPU of
    ``subset`` (``gpu:1,3``). Exactly one of the three is set."""

    __slots__ = ("number", "per", "subset")

    number: int | None
    per: str | None
    subset: tuple[int, ...] | None

    def __init__(
        self,
        number: int | None = None,
        per: str | None = None,
        subset: tuple[int, ...] | None = None,
    ) -> None:
        self._set(number=number, per=per, subset=subset)

    def __str__(self) -> str:
        """The request as ``--nproc-per-node`` takes it (a subset with its indexes listed)."""
        if self.subset is not None:
            return "gpu:" + ",".join(map(str, self.subset))
        return self.per if self.per is not None else str(self.number)

    @property
    def counts_gpus(self) -> bool:
        """Whether the machine's GPUs must be counted to know the number of workers (or, for a
        subset, to check it)."""
        return self.per in ("gpu", "auto") or self.subset is not None

    def workers(self, cpus: int, gpus: int) -> int:
        """The number of workers on a machine of ``cpus`` CPUs and ``gpus`` GPUs (0: none could
        be counted, and a subset is taken as it is); ValueError when it cannot be."""
        if self.number is not None:
            return self.number
        if self.subset is not None:
            if gpus and max(self.subset) >= gpus:
                raise ValueError(
                    f"GPU {max(self.subset)} does not exist: the launcher sees {gpus} "
                    f"(0-{gpus - 1}; CUDA_VISIBLE_DEVICES or nvidia-smi -L)"
                )
            return len(self.subset)
        if self.per == "cpu":
            return cpus
        if self.per == "gpu" and gpus == 0:
            raise ValueError(
                "no GPU found (CUDA_VISIBLE_DEVICES and nvidia-smi -L list none); give a number "
                "or use cpu"
            )
        return gpus or cpus


def parse_device_request(text: str) -> DeviceRequest:
    """``--nproc-per-node``'s text: a number of workers (1 to ``MAX_NPROC_PER_NODE``), ``cpu``,
    ``gpu``, ``auto`` or ``gpu:LIST`` (``core.workers.placement.parse_index_list``); ValueError
    saying what it takes otherwise."""
    if text in ("cpu", "gpu", "auto"):
        return DeviceRequest(per=text)
    if text.isdecimal() and text.isascii():
        if not 1 <= int(text) <= MAX_NPROC_PER_NODE:
            raise ValueError(
                f"expected 1 to {MAX_NPROC_PER_NODE} workers per node, got {text}: run more "
                "nodes for more workers"
            )
        return DeviceRequest(number=int(text))
    if text.startswith("gpu:"):
        from relaunch.core.workers.placement import parse_index_list

        try:
            return DeviceRequest(subset=parse_index_list(text[4:]))
        except ValueError as exc:
            raise ValueError(f"gpu:LIST: {exc}") from None
    raise ValueError(
        f"expected a whole number >= 1, or cpu, gpu, gpu:LIST (gpu:1,3) or auto, got {text!r}"
    )
