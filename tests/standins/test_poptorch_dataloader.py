"""``poptorch.DataLoader`` of the stand-in: combined batches, and a loader that lets its
worker processes go as soon as it is dropped."""
from __future__ import annotations

import multiprocessing
import weakref

import pytest
import torch

import ipu_standins.poptorch as poptorch


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((2,), float(index))


@pytest.mark.parametrize("mode", [poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async,
                                  poptorch.DataLoaderMode.AsyncRebatched],
                         ids=lambda mode: mode.name)
def test_a_dropped_loader_is_freed_at_once_and_its_workers_stop(mode):
    """No reference cycle holds a loader (its own accessor refers to it weakly): dropped, it is
    freed there and then, and torch's iterator stops its persistent workers. In a cycle, the
    collector would close the workers' queues first and each worker would cost a 5 s join
    time-out (dataloader_test.py of PopTorch's tests spent minutes so)."""
    options = poptorch.Options().deviceIterations(2)
    loader = poptorch.DataLoader(options, _Rows(), batch_size=3, num_workers=2, mode=mode)
    batches = [batch for batch in loader]
    assert [tuple(b.shape) for b in batches] == [(6, 2)] * 4
    assert torch.equal(torch.cat(batches)[:, 0], torch.arange(24.0))
    assert len(multiprocessing.active_children()) >= 2
    freed = weakref.ref(loader)
    del loader
    assert freed() is None
    assert multiprocessing.active_children() == []


def test_an_accessor_of_a_users_loader_keeps_that_loader():
    loader = poptorch.DataLoader(poptorch.Options(), _Rows(), batch_size=4)
    accessor = poptorch.AsynchronousDataAccessor(loader)
    del loader
    assert [tuple(b.shape) for b in accessor] == [(4, 2)] * 6


def test_persistent_workers_see_each_epochs_global_shuffle():
    """With ``Distributed`` processes and ``shuffle``, the order is drawn anew each epoch in
    the main process; persistent workers read it from shared memory."""
    options = poptorch.Options().randomSeed(0)
    options.Distributed.configureProcessId(0, 2)
    loader = poptorch.DataLoader(options, _Rows(), batch_size=4, shuffle=True, num_workers=2)
    epochs = [sorted(torch.cat(list(loader))[:, 0].tolist()) for _ in range(3)]
    assert all(len(epoch) == 12 for epoch in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


@pytest.mark.parametrize("mode", [poptorch.DataLoaderMode.Async,
                                  poptorch.DataLoaderMode.AsyncRebatched],
                         ids=lambda mode: mode.name)
def test_a_loader_left_mid_epoch_stops_its_workers_when_dropped(mode):
    loader = poptorch.DataLoader(poptorch.Options(), _Rows(), batch_size=2, num_workers=2,
                                 mode=mode)
    for batch in loader:
        assert tuple(batch.shape) == (2, 2)
        break
    freed = weakref.ref(loader._accessor)
    del loader, batch
    assert freed() is None
    assert multiprocessing.active_children() == []


class _EveryOther(torch.utils.data.Sampler):
    def __init__(self, data_source):  # as samplers written for the SDK's torch 2.0.1 do
        super().__init__(data_source)
        self.rows = len(data_source)

    def __iter__(self):
        return iter(range(0, self.rows, 2))

    def __len__(self):
        return (self.rows + 1) // 2


def test_a_sampler_passing_its_data_source_to_sampler_works_as_on_the_sdks_torch():
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    loader = poptorch.DataLoader(poptorch.Options(), data, batch_size=1,
                                 sampler=_EveryOther(data))
    assert [float(batch[0]) for batch in loader] == [0.0, 2.0, 4.0, 6.0, 8.0]


@pytest.mark.parametrize("mode", [poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async],
                         ids=lambda mode: mode.name)
def test_a_user_batch_sampler_s_batches_are_combined_in_every_mode(mode):
    """5 device iterations of the sampler's batches of 2 rows: 2 combined batches of 10 rows
    from the 12 batches (the last 2 dropped), whether the batches come asynchronously or not."""
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(_Rows()),
                                            batch_size=2, drop_last=True)
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(5), _Rows(),
                                 batch_sampler=sampler, drop_last=True, mode=mode)
    batches = list(loader)
    assert len(loader) == 2
    assert [b.shape for b in batches] == [torch.Size([10, 2])] * 2
    assert batches[1][:, 0].tolist() == [float(i) for i in range(10, 20)]
