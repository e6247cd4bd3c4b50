"""The quarantine across epochs: ``Recover(example_id=...)`` names the bad examples by
an id the batch carries, which still names them once the data is shuffled, and
``jaxstep.read_quarantine(dir).ids`` is what the next epoch's pipeline filters on."""

import json

import numpy as np
import optax
import pytest

import jaxstep
from tests.models import BATCH
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

NUM_BATCHES = 4
BAD = 77  # the id (and index) of the one corrupt record


class _Records:
    """A grain source: record i of the data, carrying its id i; record BAD is corrupt."""

    def __init__(self):
        self.batches = make_batches(NUM_BATCHES)

    def __len__(self) -> int:
        return NUM_BATCHES * BATCH

    def __getitem__(self, i: int) -> dict:
        b, r = divmod(int(i), BATCH)
        record = {k: np.array(v[r]) for k, v in self.batches[b].items()}
        if i == BAD:
            record["x"] = np.full_like(record["x"], np.nan)
        return dict(record, id=np.int64(i))

    def __repr__(self) -> str:
        return "_Records()"


def _loader(epoch: int, quarantined=frozenset()):
    """One epoch, shuffled by its own seed, without the records quarantined."""
    import grain

    class Clean(grain.transforms.Filter):
        def filter(self, record) -> bool:
            return int(record["id"]) not in quarantined

    source = _Records()
    sampler = grain.samplers.IndexSampler(len(source), shuffle=True, num_epochs=1, seed=epoch)
    batch = grain.transforms.Batch(batch_size=BATCH, drop_remainder=True)
    return grain.DataLoader(
        data_source=source, sampler=sampler, operations=[Clean(), batch], worker_count=0
    )


def _seen(loader, ids: list) -> object:
    """The loader's batches, each batch's ids noted as it is pulled."""
    for batch in loader:
        ids.append(batch["id"].tolist())
        yield batch


def test_a_bad_record_quarantined_by_id_is_filtered_out_of_the_next_shuffled_epoch(
    backend, tmp_path
):
    pytest.importorskip("grain")
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    recover = jaxstep.Recover(example_id="id")
    first, ids = jaxstep.History(), []
    state = jaxstep.fit(
        step,
        step.init(init_params()),
        _seen(_loader(epoch=1), ids),
        recover=recover,
        history=first,
        checkpoint_dir=tmp_path,
    )
    (record,) = first.recoveries
    at = next(i for i, batch in enumerate(ids) if BAD in batch)  # where the shuffle put it
    example = ids[at].index(BAD)
    assert (record.verdict, record.action, record.batch) == ("data", "quarantined", at)
    assert record.examples == (example,) and record.example_ids == (BAD,)
    assert f"(ids [{BAD}])" in str(record)
    text = (tmp_path / "quarantine.jsonl").read_text()
    (line,) = [json.loads(one) for one in text.splitlines()]
    assert (line["batch"], line["examples"], line["ids"]) == (at, [example], [BAD])
    assert (line["example_id"], line["fit_start"]) == ("id", 0)  # the first fit call's
    quarantined = jaxstep.read_quarantine(tmp_path)
    assert quarantined.ids == {BAD} and quarantined == {at: (example,)}

    # The next epoch, shuffled anew: the pipeline filters the id, the run meets no failure
    second, ids = jaxstep.History(), []
    state = jaxstep.fit(
        step,
        state,
        _seen(_loader(epoch=2, quarantined=quarantined.ids), ids),
        recover=recover,
        history=second,
        checkpoint_dir=tmp_path,
    )
    assert second.recoveries == [] and second.step == [4, 5, 6]  # 127 records: 3 batches
    assert all(BAD not in batch for batch in ids)
    assert len({i for batch in ids for i in batch}) == 3 * BATCH
    assert jaxstep.read_quarantine(tmp_path).lines == quarantined.lines  # nothing new


def test_an_example_id_that_names_no_leaf_is_refused_before_anything_runs(backend):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    state = step.init(init_params())
    batches = make_batches(2)
    with pytest.raises(ValueError, match=r"example_id='idx'.*\['idx'\].*\['pos'\]") as info:
        jaxstep.fit(step, state, batches, recover=jaxstep.Recover(example_id="idx"))
    # handed back, not lost, with the one the prefetch pulled after it
    assert [b is x for b, x in zip(info.value.batches, batches, strict=False)] == [True] * len(
        info.value.batches
    )
    assert info.value.batches[0] is batches[0]
    info.value.state.step  # noqa: B018  the state is usable
    floats = [dict(b, id=np.zeros(BATCH, np.float32)) for b in batches]
    with pytest.raises(TypeError, match="example ids must be integers"):
        jaxstep.fit(step, state, floats, recover=jaxstep.Recover(example_id="id"))
    with pytest.raises(TypeError, match="example_id"):
        jaxstep.Recover(example_id=3)


def test_a_quarantine_file_written_before_ids_reads_as_before(tmp_path):
    old = {"step": 5, "batch": 5, "examples": [40], "rows": [200], "batch_size": 32,
           "device_ids": [3], "time": 1.0}  # fmt: skip
    (tmp_path / "quarantine.jsonl").write_text(json.dumps(old) + "\n" + '{"step": 7, "bat')
    read = jaxstep.read_quarantine(tmp_path)
    assert read == {5: (40,)} and read.get(5) == (40,) and read.ids == frozenset()
    assert read.lines == (old,)  # the line cut short by a crash passed over
