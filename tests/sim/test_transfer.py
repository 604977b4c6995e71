"""What travels between the simulator's driver and its Ray workers (sim/transfer.py): a site's upload
as one array comes back bit for bit, names, order, shapes and dtypes kept; named tuples survive; and
--sites-per-task, how many sites one Ray task carries, reaches the executor section."""

import pickle

import torch

from fedcontrast.robust.screen import UploadFacts
from fedcontrast.sim.transfer import pack, pack_flat, unpack


def test_an_upload_packed_flat_comes_back_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    upload = {"model.w": torch.randn(3, 4, generator=g), "model.b": torch.randn(5, generator=g),
              "model.s": torch.tensor(2.0), "model.e": torch.zeros(0, 3)}
    back = unpack(pickle.loads(pickle.dumps(pack_flat(upload))))
    assert list(back) == list(upload)
    for name, t in upload.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t)
    mixed = {"a": torch.randn(2, generator=g), "b": torch.arange(3)}  # dtypes differ: one array each
    assert all(torch.equal(unpack(pack_flat(mixed))[k], v) for k, v in mixed.items())
    assert unpack(pack_flat({})) == {}


def test_facts_travel_as_named_tuples():
    facts = UploadFacts(("model.w",), 1.5, None, True)
    assert unpack(pickle.loads(pickle.dumps(pack(facts)))) == facts


def test_sites_per_task_on_the_command_line_goes_to_the_executor_section():
    from fedcontrast.cli import build_parser, config_from_args

    args = build_parser().parse_args(["simulate", "--executor", "ray", "--sites-per-task", "3"])
    config = config_from_args(args)
    assert config.executor.kind == "ray" and config.executor.sites_per_task == 3
    assert config.to_dict()["executor"]["sites_per_task"] == 3  # recorded in config.yaml
