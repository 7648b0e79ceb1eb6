"""The pieces of a daemon across ranks that need no second process: the broadcast message, the shard check, the handshake."""

from __future__ import annotations

import json
import pickle

import pytest

from prefixd.daemon.distributed.handshake import RanksDisagree, check_peers
from prefixd.daemon.distributed.messages import IterationInputs, JobSpec, StoreOp
from prefixd.daemon.distributed.settings import DistributedSettings, started_by_launcher
from prefixd.daemon.distributed.sharded_loading import NotShardable, check_shardable
from prefixd.protocol.methods import parse_generate


def test_what_rank_0_broadcasts_comes_back_whole():
    params = parse_generate({"prompt": "hello", "max_tokens": 3, "stop": ["\n"]})
    inputs = IterationInputs(number=7, clock=12.5, prefill_tokens_per_s=300.0,
                             jobs=(JobSpec(4, "c1", 9, params, False, None),), cancels=(3,),
                             store_ops=(StoreOp("pin_tokens", ("llama", [1, 2, 3], True)),))
    assert IterationInputs.decode(inputs.encode()) == inputs


def test_a_message_of_another_type_is_refused():
    with pytest.raises(TypeError, match="not IterationInputs"):
        IterationInputs.decode(pickle.dumps({"number": 1}))


def write_config(path, **fields):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **fields}))
    return path


def test_heads_that_do_not_divide_are_refused_with_the_rank_counts_that_work(tmp_path):
    smol = write_config(tmp_path / "smol", num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    with pytest.raises(NotShardable, match="num_attention_heads = 9 does not divide over 2 ranks.*work for this model: 3"):
        check_shardable(smol, 2)
    check_shardable(smol, 3)
    check_shardable(write_config(tmp_path / "tiny", num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=512), 2)


class FakeChannel:
    """What check_peers needs of a Channel: every rank's bytes from gather()."""

    def __init__(self, identities):
        self.size = len(identities)
        self._payloads = [json.dumps(ident, sort_keys=True).encode() for ident in identities]

    def gather(self, payload):
        assert payload == self._payloads[0]  # this process plays rank 0
        return self._payloads


def test_the_handshake_names_the_field_and_each_ranks_value():
    same = {"prefixd": "0.1.0+abc", "--cache-bytes": 1 << 30}
    check_peers(FakeChannel([same, same]), "before loading", same)
    other = {"prefixd": "0.1.0+abc", "--cache-bytes": 2 << 30}
    with pytest.raises(RanksDisagree, match=r"differ before loading: --cache-bytes \(rank 0: 1073741824, rank 1: 2147483648\)"):
        check_peers(FakeChannel([same, other]), "before loading", same)


def test_settings_and_launcher_detection():
    assert started_by_launcher({"MLX_RANK": "1"}) and not started_by_launcher({})
    with pytest.raises(ValueError, match="unknown backend"):
        DistributedSettings(backend="carrier-pigeon", rank_timeout_seconds=10)
    with pytest.raises(ValueError, match="positive"):
        DistributedSettings(backend="ring", rank_timeout_seconds=0)


def test_pipeline_mode_needs_a_model_that_offers_it_and_layers_that_divide(tmp_path):
    llama = write_config(tmp_path / "llama", num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                         num_hidden_layers=4)
    with pytest.raises(NotShardable, match=r"llama \(llama\) cannot run pipeline-parallel.*offers tensor only"):
        check_shardable(llama, 2, "pipeline")
    ministral = write_config(tmp_path / "ministral", model_type="ministral3", num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=512, num_hidden_layers=6)
    check_shardable(ministral, 2, "pipeline")
    check_shardable(ministral, 3, "pipeline")
    check_shardable(ministral, 2, "tensor")  # its mlx-lm code offers both
    with pytest.raises(NotShardable, match="num_hidden_layers = 6 does not divide over 4 ranks.*pipeline mode: 2, 3, 6"):
        check_shardable(ministral, 4, "pipeline")


def test_an_unknown_parallel_mode_is_refused():
    with pytest.raises(ValueError, match="unknown parallel mode 'diagonal': one of tensor, pipeline"):
        DistributedSettings(backend="ring", rank_timeout_seconds=10, parallel="diagonal")


def test_a_backends_error_is_told_apart_from_a_requests_own():
    from prefixd.daemon.distributed.channel import RankLost, is_collective_failure

    assert is_collective_failure(RuntimeError("[ring] connection to a peer was lost"))
    assert is_collective_failure("internal error: RuntimeError: [nccl] unhandled system error")
    assert is_collective_failure(RankLost("rank 1 of 2: a collective failed"))
    assert not is_collective_failure(RuntimeError("[matmul] Last dimension of first input with shape (1,3)"))
    assert not is_collective_failure(ValueError("the prompt is longer than the context"))


def test_ranks_sharing_a_host_share_its_cores_and_a_users_setting_is_kept(tmp_path):
    from prefixd.daemon.distributed.cpu_threads import ranks_on_this_host, share_cpu_threads

    local = tmp_path / "local.json"
    local.write_text(json.dumps([["127.0.0.1:32323"], ["127.0.0.1:32324"]]))
    two_hosts = tmp_path / "two-hosts.json"
    two_hosts.write_text(json.dumps([["10.0.0.1:32323"], ["10.0.0.2:32323"]]))
    assert ranks_on_this_host({"MLX_RANK": "1", "MLX_HOSTFILE": str(local)}) == 2
    assert ranks_on_this_host({"MLX_RANK": "0", "MLX_HOSTFILE": str(two_hosts)}) == 1
    assert ranks_on_this_host({"MLX_RANK": "0"}) is None  # not ring: unknown
    environ = {"MLX_RANK": "0", "MLX_HOSTFILE": str(local)}
    assert share_cpu_threads(environ, num_cores=2) == {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    assert environ["OPENBLAS_NUM_THREADS"] == "1"
    assert share_cpu_threads({"MLX_RANK": "0", "MLX_HOSTFILE": str(local)}, num_cores=16)["OMP_NUM_THREADS"] == "8"
    mine = {"MLX_RANK": "0", "MLX_HOSTFILE": str(local), "OPENBLAS_NUM_THREADS": "4"}
    assert share_cpu_threads(mine, num_cores=2) == {} and mine["OPENBLAS_NUM_THREADS"] == "4"
    assert share_cpu_threads({"MLX_RANK": "0", "MLX_HOSTFILE": str(two_hosts)}, num_cores=2) == {}
