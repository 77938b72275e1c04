"""``poptorch.DataLoader`` and ``poptorch.AsynchronousDataAccessor``.

The loader gives each call of a PopTorch model its combined batch: ``batch_size x
deviceIterations x (replicationFactor / input group size) x gradientAccumulation`` samples
(PopTorch's ``combinedBatchSize``), per process when ``Distributed`` splits the data.
``DataLoaderMode.Async`` and ``AsyncRebatched`` load through an
:class:`AsynchronousDataAccessor`; the stand-in's accessor loads in the calling thread (the
same batches, in the same order; no worker process), rebatching into combined batches when
asked.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Iterator, List, Optional, Union

import torch

from . import enums
from ._args import flatten, rebuild
from ._impl import createPoptorchError
from .options import Options

__all__ = ["DataLoader", "AsynchronousDataAccessor"]


def _sampler_takes_its_data_source() -> None:
    """PopTorch programs are written for the Poplar SDK's torch (2.0.1), whose ``Sampler``
    takes its data source (``super().__init__(data_source)``, ignored); later torch dropped the
    argument, so such a sampler fails with ``object.__init__() takes exactly one argument``.
    Where ``Sampler`` has no ``__init__`` of its own, give it 2.0.1's."""
    sampler = torch.utils.data.Sampler
    if "__init__" not in vars(sampler):
        def __init__(self: Any, data_source: Any = None) -> None:
            pass

        sampler.__init__ = __init__  # type: ignore[method-assign]


_sampler_takes_its_data_source()


def _concat(batches: List[Any]) -> Any:
    tensors = [flatten(b) for b in batches]
    joined = [torch.cat([t[i] for t in tensors]) for i in range(len(tensors[0]))]
    return rebuild(batches[-1], joined)


def _split(batch: Any, start: int, stop: int) -> Any:
    return rebuild(batch, [t[start:stop] for t in flatten(batch)])


def _rows(batch: Any) -> int:
    tensors = flatten(batch)
    return tensors[0].shape[0] if tensors and tensors[0].dim() else 1


def _rebatched(batches: Iterator[Any], size: int, drop_last: bool) -> Iterator[Any]:
    """``batches`` regrouped into batches of ``size`` rows. A function, not a method of the
    accessor that keeps the generator: a generator holding its accessor would be a reference
    cycle, and a torch iterator in a cycle stops its workers slowly (see
    ``AsynchronousDataAccessor._belong_to``)."""
    pending, rows = [], 0
    for batch in batches:
        pending.append(batch)
        rows += _rows(batch)
        while rows >= size:
            joined = _concat(pending)
            yield _split(joined, 0, size)
            rest = rows - size
            pending = [_split(joined, size, rows)] if rest else []
            rows = rest
    if pending and rows and not drop_last:
        yield _concat(pending)


class _SubDataset(torch.utils.data.Dataset):
    """This process's share of a dataset split between ``Distributed`` processes. With
    ``drop_last`` each share is a multiple of the combined batch and the elements left over
    alternate, epoch by epoch, between the start and the end of the data; shuffling permutes
    the whole dataset the same way in every process (the options' random seed), anew each
    epoch."""

    def __init__(self, dataset: Any, options: Options, step: int, drop_last: bool):
        count = len(dataset)
        processes, rank = options.Distributed.numProcesses, options.Distributed.processId
        if drop_last:
            per_process = step * (count // (step * processes))
            self._offset = rank * per_process
            self._length = min(per_process, count - self._offset)
            self._leftovers = count % per_process if per_process else 0
        else:
            shares = [count // processes + (count % processes > p) for p in range(processes)]
            self._offset = sum(shares[:rank])
            self._length = shares[rank]
            self._leftovers = 0
        self._base_offset = self._offset
        self._dataset = dataset
        self._seed = options.random_seed if options.exists("random_seed") else None
        self._generator_state: Optional[torch.Tensor] = None
        self._order: Optional[torch.Tensor] = None

    def shuffle_global_indices(self) -> None:
        generator = torch.Generator()
        if self._generator_state is None:
            assert self._seed is not None, (
                "Seed must be set when shuffling so that all instances end up with the same "
                "shuffled global indices.")
            generator.manual_seed(self._seed)
        else:
            generator.set_state(self._generator_state)
        order = torch.randperm(len(self._dataset), generator=generator)
        # In shared memory, rewritten in place: persistent workers (which hold a copy of this
        # dataset since their start) see each epoch's order too.
        if self._order is None:
            self._order = order.share_memory_()
        else:
            self._order.copy_(order)
        self._generator_state = generator.get_state()

    def swap_range(self) -> None:
        self._offset = (self._base_offset + self._leftovers
                        if self._offset == self._base_offset else self._base_offset)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        if index >= self._length:
            raise IndexError(index)
        position = index + self._offset
        if self._order is not None:
            position = int(self._order[position])
        return self._dataset[position]


class DataLoader(torch.utils.data.DataLoader):
    """A torch ``DataLoader`` whose batches are PopTorch's combined batches."""

    def __init__(self, options: Options, dataset: Any, batch_size: Optional[int] = 1,
                 shuffle: Optional[bool] = None, num_workers: int = 0, drop_last: bool = True,
                 persistent_workers: Optional[bool] = None,
                 auto_distributed_partitioning: bool = True,
                 mode: enums.DataLoaderMode = enums.DataLoaderMode.Sync,
                 async_options: Optional[Dict[str, Any]] = None,
                 rebatched_worker_size: Optional[int] = None, batch_sampler: Any = None,
                 **kwargs: Any) -> None:
        self._is_user_batch_sampler_set = batch_sampler is not None
        if self._is_user_batch_sampler_set:
            if batch_size != 1 or shuffle:
                raise createPoptorchError("`batch_sampler` option is mutually exclusive with "
                                          "batch_size, shuffle.")
            if options.Distributed.numProcesses > 1 and auto_distributed_partitioning:
                raise createPoptorchError("`batch_sampler` option is mutually exclusive with "
                                          "auto_distributed_partitioning=True.")
            batch_size = getattr(batch_sampler, "batch_size", batch_size)
            self.batch_sampler_drop_last = drop_last
            loader_drop_last: Optional[bool] = None
        else:
            shuffle = bool(shuffle)
            loader_drop_last = drop_last
        assert isinstance(options, Options)
        options._freeze()
        self._options = options
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        groups = options.replication_factor // options.input_group_size
        if batch_size is None:
            self._combined_batch_size: Optional[int] = None
            self._num_batches_to_combine: Optional[int] = None
        else:
            self._num_batches_to_combine = (options.device_iterations * groups
                                            * options.Training.gradient_accumulation)
            self._combined_batch_size = batch_size * self._num_batches_to_combine
        self._is_iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        self._accessor: Optional[AsynchronousDataAccessor] = None
        self._shuffle_globally = False
        if self._is_iterable:
            if auto_distributed_partitioning:
                assert options.Distributed.numProcesses == 1, (
                    "auto_distributed_partitioning not supported for IterableDataset")
        elif options.Distributed.numProcesses > 1 and auto_distributed_partitioning:
            assert not shuffle or options.exists("random_seed"), (
                "When using auto_distributed_partitioning you must set "
                "poptorch.Options.randomSeed() to ensure that tensors are in the same order in "
                "all processes.")
            assert self._combined_batch_size is not None, (
                "batch_size=None not allowed when using auto_distributed_partitioning.")
            dataset = _SubDataset(dataset, options, self._combined_batch_size, drop_last)
            if shuffle:
                self._shuffle_globally = True
                shuffle = False
        per_batch = 1 if self._is_user_batch_sampler_set else self._combined_batch_size
        real_drop_last = (self.batch_sampler_drop_last if self._is_user_batch_sampler_set
                          else drop_last)
        rebatched_size = None
        bigger = self._combined_batch_size is not None and self._combined_batch_size > 1
        if mode == enums.DataLoaderMode.AsyncRebatched or (
                mode == enums.DataLoaderMode.Async and not real_drop_last and bigger):
            mode = enums.DataLoaderMode.Async
            rebatched_size = self._combined_batch_size
            self.rebatched_drop_last = drop_last
            loader_drop_last = False
            if rebatched_worker_size is not None:
                assert self._combined_batch_size is not None
                assert rebatched_worker_size <= self._combined_batch_size, (
                    f"The rebatched_worker_size ({rebatched_worker_size}) must be <= to the "
                    f"combined batch size ({self._combined_batch_size})")
                per_batch = rebatched_worker_size
        if self._is_user_batch_sampler_set:
            kwargs["batch_sampler"] = batch_sampler
            super().__init__(dataset, num_workers=num_workers,
                             persistent_workers=persistent_workers, **kwargs)
        else:
            super().__init__(dataset, batch_size=per_batch, shuffle=shuffle,
                             num_workers=num_workers, drop_last=bool(loader_drop_last),
                             persistent_workers=persistent_workers, **kwargs)
        if mode == enums.DataLoaderMode.Async:
            async_options = dict(async_options or {})
            assert "rebatched_size" not in async_options, (
                "You cannot use DataLoaderMode.AsyncRebatched and manually specify the "
                "rebatched_size in async_options")
            self._accessor = AsynchronousDataAccessor(self, **async_options,
                                                      rebatched_size=rebatched_size)
            self._accessor._belong_to(self)

    def __len__(self) -> int:
        if self._accessor is not None and self._accessor.rebatched_size:
            count = len(self.dataset)  # type: ignore[arg-type]
            length = count // self._accessor.rebatched_size
            if not self.rebatched_drop_last and count % self._accessor.rebatched_size:
                length += 1
            return length
        length = super().__len__()
        if self._is_user_batch_sampler_set and self._num_batches_to_combine:
            full, rest = divmod(length, self._num_batches_to_combine)
            return full + (1 if rest and not self.batch_sampler_drop_last else 0)
        return length

    @property
    def combinedBatchSize(self) -> Optional[int]:
        return self._combined_batch_size

    @property
    def options(self) -> Options:
        return self._options

    def terminate(self) -> None:
        if self._accessor is not None:
            self._accessor.terminate()

    def _torch_iter(self) -> Iterator[Any]:
        return torch.utils.data.DataLoader.__iter__(self)

    def __iter__(self) -> Any:
        if self._shuffle_globally:
            self.dataset.shuffle_global_indices()  # type: ignore[attr-defined]
            self.dataset.swap_range()  # type: ignore[attr-defined]
        if self._accessor is not None:
            return iter(self._accessor)
        if self._is_user_batch_sampler_set and self._num_batches_to_combine not in (None, 1):
            return self._combined()
        return self._torch_iter()

    def _combined(self) -> Iterator[Any]:
        pending: List[Any] = []
        assert self._num_batches_to_combine is not None
        for batch in self._torch_iter():
            pending.append(batch)
            if len(pending) == self._num_batches_to_combine:
                yield _concat(pending)
                pending = []
        if pending and not self.batch_sampler_drop_last:
            yield _concat(pending)


class AsynchronousDataAccessor:
    """Loads a dataset (or a :class:`DataLoader`) ahead of the model; here in the calling
    thread. ``rebatched_size`` regroups the loaded batches into batches of that many rows."""

    def __init__(self, dataset: Union[Any, DataLoader], buffer_size: int = 3,
                 miss_sleep_time_in_ms: float = 0.1, load_indefinitely: bool = True,
                 early_preload: bool = False,
                 sharing_strategy: enums.SharingStrategy = enums.SharingStrategy.ForkServer,
                 rebatched_size: Optional[int] = None) -> None:
        if isinstance(dataset, DataLoader) and dataset._accessor is not None:
            raise createPoptorchError(
                "The DataLoader already uses an AsynchronousDataAccessor internally. Either "
                "use the existing one or set mode='poptorch.DataLoaderMode.Sync' in the "
                "DataLoader.")
        if isinstance(dataset, DataLoader) and not dataset._is_user_batch_sampler_set and (
                not dataset.drop_last and rebatched_size is None):
            assert dataset.combinedBatchSize in (None, 1), (
                "The 'drop_last=False' option from the DataLoader only works if "
                "'rebatched_size' is specified too.")
        if rebatched_size is not None:
            assert rebatched_size > 1, "rebatched_size must be None or greater than 1"
        self._source_data: Any = dataset
        self.rebatched_size = rebatched_size
        self._alive = True
        self._iterator: Optional[Iterator[Any]] = None

    @property
    def _dataset(self) -> Any:
        source = self._source_data
        return source() if isinstance(source, weakref.ref) else source

    def _belong_to(self, loader: DataLoader) -> None:
        """A loader's own accessor refers to it weakly. A reference cycle between the two
        would leave the loader to the cycle collector, which closes its worker queues before
        torch's iterator can send its workers the word to stop: every worker of a persistent
        loader then cost a 5 s join time-out at exit."""
        self._source_data = weakref.ref(loader)

    def terminate(self) -> None:
        self._alive = False

    def __len__(self) -> int:
        length = len(self._dataset)
        if self.rebatched_size and getattr(self._dataset, "_accessor", None) is not self:
            length = length * int(self._dataset.batch_size or 1) // self.rebatched_size
        return length

    def _source(self) -> Iterator[Any]:
        loader = self._dataset
        if isinstance(loader, DataLoader):
            if not self.rebatched_size and loader._is_user_batch_sampler_set and (
                    loader._num_batches_to_combine not in (None, 1)):
                return loader._combined()  # the user's batches combined, as in Sync mode
            return loader._torch_iter()
        return iter(loader)

    def _batches(self) -> Iterator[Any]:
        source = self._source()
        if not self.rebatched_size:
            return source
        drop_last = getattr(self._dataset, "rebatched_drop_last", True)
        return _rebatched(source, self.rebatched_size, drop_last)

    def __iter__(self) -> AsynchronousDataAccessor:
        assert self._alive, "The AsynchronousDataAccessor has been terminated"
        self._iterator = self._batches()
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = self._batches()
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = None
            raise
