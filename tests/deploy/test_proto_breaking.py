"""The protos stay wire-compatible with the last release (proto/released.txtpb), and the check catches each
kind of breaking change on an edited copy of proto/ while letting additions through."""

import shutil

import pytest

from services.common import proto_breaking
from services.common.protogen import PROTO_DIR

ROLLOUT = "openmanus/rollout/v1/rollout.proto"
ENVS = "openmanus/envs/v1/envs.proto"
REWARD = "openmanus/reward/v1/reward.proto"


@pytest.fixture(scope="module")
def released():
    return proto_breaking.load()


def edited(tmp_path, path, *replacements):
    """The descriptors of a copy of proto/ with `path` edited by (old, new) text replacements."""
    root = tmp_path / "proto"
    shutil.copytree(PROTO_DIR, root)
    text = (root / path).read_text()
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    (root / path).write_text(text)
    return proto_breaking.build(root)


def test_the_protos_are_compatible_with_the_last_release(released):
    found = proto_breaking.breaking_changes(released, proto_breaking.build())
    assert found == [], (
        "breaking changes against proto/released.txtpb; on a deliberate release (a new "
        "package version) run `python -m services.common.proto_breaking release`"
    )


def test_additions_are_not_breaking(released, tmp_path):
    new = edited(
        tmp_path,
        ROLLOUT,
        ("  optional uint64 seed = 6;\n", "  optional uint64 seed = 6;\n  float min_p = 7;\n"),
        (
            "  rpc GetStatus(GetStatusRequest) returns (RolloutStatus);\n",
            "  rpc GetStatus(GetStatusRequest) returns (RolloutStatus);\n"
            "  rpc Drain(GetStatusRequest) returns (RolloutStatus);\n",
        ),
        (
            "message GetStatusRequest {}",
            "message GetStatusRequest {}\nenum Mode { MODE_UNSPECIFIED = 0; }\nmessage Extra { Mode mode = 1; }",
        ),
    )
    assert proto_breaking.breaking_changes(released, new) == []


def test_a_deleted_field_breaks_unless_its_number_and_name_are_reserved(released, tmp_path):
    deleted = edited(tmp_path / "a", ROLLOUT, ("  optional uint64 seed = 6;\n", ""))
    assert proto_breaking.breaking_changes(released, deleted) == [
        "field openmanus.rollout.v1.SamplingParams.seed (number 6) deleted without reserving its number and name"
    ]
    number_only = edited(tmp_path / "b", ROLLOUT, ("  optional uint64 seed = 6;\n", "  reserved 6;\n"))
    assert len(proto_breaking.breaking_changes(released, number_only)) == 1
    reserved = edited(tmp_path / "c", ROLLOUT, ("  optional uint64 seed = 6;\n", '  reserved 6;\n  reserved "seed";\n'))
    assert proto_breaking.breaking_changes(released, reserved) == []


@pytest.mark.parametrize(
    "path, old, new, expected",
    [
        (
            ROLLOUT,
            "string finish_reason = 3;",
            "string finish_reason = 9;",
            "field openmanus.rollout.v1.GenerateResponse.finish_reason (number 3) renumbered to 9",
        ),
        (
            ROLLOUT,
            "string checksum = 3;\n  // Deliberately",
            "string sha256 = 3;\n  // Deliberately",
            "field openmanus.rollout.v1.WeightUpdateHeader.checksum (number 3) renamed to sha256",
        ),
        (
            ROLLOUT,
            "float top_p = 3;",
            "double top_p = 3;",
            "field openmanus.rollout.v1.SamplingParams.top_p (number 3) changed type from float to double",
        ),
        (
            ROLLOUT,
            "repeated uint32 stop_token_ids = 5;",
            "uint32 stop_token_ids = 5;",
            "field openmanus.rollout.v1.SamplingParams.stop_token_ids (number 5) changed from repeated to singular",
        ),
        (
            ROLLOUT,
            "optional uint64 seed = 6;",
            "uint64 seed = 6;",
            "field openmanus.rollout.v1.SamplingParams.seed (number 6) changed from optional to singular",
        ),
        (
            ROLLOUT,
            "    bytes data = 2;\n    WeightBucket bucket = 3;\n    WeightCommit commit = 4;\n  }\n",
            "    WeightBucket bucket = 3;\n    WeightCommit commit = 4;\n  }\n  bytes data = 2;\n",
            "field openmanus.rollout.v1.WeightChunk.data (number 2) moved from oneof 'payload' to ''",
        ),
        (
            ROLLOUT,
            "  rpc GetStatus(GetStatusRequest) returns (RolloutStatus);\n",
            "",
            "rpc openmanus.rollout.v1.RolloutService.GetStatus deleted",
        ),
        (
            ROLLOUT,
            "rpc UpdateWeights(stream WeightChunk)",
            "rpc UpdateWeights(WeightChunk)",
            "rpc openmanus.rollout.v1.RolloutService.UpdateWeights stopped being client-streaming",
        ),
        (
            ENVS,
            "rpc Close(CloseRequest) returns (CloseResponse);",
            "rpc Close(CloseRequest) returns (EpisodeState);",
            "rpc openmanus.envs.v1.EnvService.Close changed its response type from openmanus.envs.v1.CloseResponse to "
            "openmanus.envs.v1.EpisodeState",
        ),
        (
            ENVS,
            "google.protobuf.Struct info = 6;",
            "string info = 6;",
            "field openmanus.envs.v1.EpisodeState.info (number 6) changed type from google.protobuf.Struct to string",
        ),
    ],
)
def test_each_kind_of_breaking_change_is_caught(released, tmp_path, path, old, new, expected):
    assert expected in proto_breaking.breaking_changes(released, edited(tmp_path, path, (old, new)))


def test_a_renamed_package_or_message_is_a_deletion(released, tmp_path):
    found = proto_breaking.breaking_changes(
        released, edited(tmp_path / "a", REWARD, ("package openmanus.reward.v1;", "package openmanus.reward.v2;"))
    )
    assert "package openmanus.reward.v1 deleted" in found
    assert f"file {REWARD} changed package from openmanus.reward.v1 to openmanus.reward.v2" in found
    assert "service openmanus.reward.v1.RewardService deleted" in found
    found = proto_breaking.breaking_changes(
        released, edited(tmp_path / "b", ROLLOUT, ("TensorSpec", "TensorDescription"))
    )
    assert found == [
        "message openmanus.rollout.v1.TensorSpec deleted",
        "field openmanus.rollout.v1.WeightUpdateHeader.tensors (number 2) changed type from "
        "openmanus.rollout.v1.TensorSpec to openmanus.rollout.v1.TensorDescription",
    ]


def test_enum_values_keep_their_numbers_and_names(tmp_path):
    enum = "enum Mode {\n  MODE_UNSPECIFIED = 0;\n  MODE_FAST = 1;\n  MODE_SAFE = 2;\n}\nmessage GetStatusRequest {}"
    old = edited(tmp_path / "old", ROLLOUT, ("message GetStatusRequest {}", enum))
    renamed = edited(tmp_path / "a", ROLLOUT, ("message GetStatusRequest {}", enum.replace("MODE_FAST", "MODE_QUICK")))
    assert proto_breaking.breaking_changes(old, renamed) == [
        "enum value openmanus.rollout.v1.Mode.MODE_FAST (number 1) renamed to MODE_QUICK"
    ]
    deleted = edited(tmp_path / "b", ROLLOUT, ("message GetStatusRequest {}", enum.replace("  MODE_SAFE = 2;\n", "")))
    assert proto_breaking.breaking_changes(old, deleted) == [
        "enum value openmanus.rollout.v1.Mode.MODE_SAFE (number 2) deleted without reserving its number and name"
    ]
    reserved = edited(
        tmp_path / "c",
        ROLLOUT,
        ("message GetStatusRequest {}", enum.replace("  MODE_SAFE = 2;\n", '  reserved 2;\n  reserved "MODE_SAFE";\n')),
    )
    assert proto_breaking.breaking_changes(old, reserved) == []


def test_the_snapshot_round_trips(tmp_path):
    current = proto_breaking.build()
    proto_breaking.write(current, tmp_path / "released.txtpb")
    assert proto_breaking.load(tmp_path / "released.txtpb") == current
