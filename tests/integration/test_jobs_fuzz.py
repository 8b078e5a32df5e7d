"""Schemathesis against the served OpenAPI document: generated requests to every operation, valid ones
(positive) and ones that break the schema (negative), with the token. The API must never answer with a
server error and must answer as its document says. Bounded by max_examples per operation; the launcher
is scripted, so no job really runs."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from services.jobs.app import create_app
from services.jobs.settings import JobsSettings
from tests.support.fake_launcher import FakeLauncher
from tests.support.live_api import LiveApi

TOKEN = "fuzz-token"
MAX_EXAMPLES = 40
DOCUMENT = create_app(JobsSettings(token=TOKEN)).openapi()
SCHEMA = schemathesis.openapi.from_dict(DOCUMENT)
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]


def has_inputs(operation) -> bool:
    """Negative cases need something to break: parameters, a body, or the credentials."""
    spec = DOCUMENT["paths"][operation.path][operation.method.lower()]
    return any(key in spec for key in ("parameters", "requestBody", "security"))


CASES = [(op, GenerationMode.POSITIVE) for op in OPERATIONS] + [
    (op, GenerationMode.NEGATIVE) for op in OPERATIONS if has_inputs(op)
]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    app_settings = JobsSettings(token=TOKEN, db=tmp_path_factory.mktemp("fuzz") / "jobs.sqlite", poll_interval_s=0.2)
    with LiveApi(create_app(app_settings, launcher=FakeLauncher(("running", "succeeded")))) as api:
        assert httpx.get(f"{api.url}/openapi.json").json() == DOCUMENT  # fuzzing what the server serves
        yield api


def test_every_operation_is_fuzzed():
    assert {op.label for op in OPERATIONS} >= {
        "POST /v1/jobs",
        "GET /v1/jobs",
        "GET /v1/jobs/{job_id}",
        "POST /v1/jobs/{job_id}/cancel",
        "GET /v1/jobs/{job_id}/events",
        "GET /v1/jobs/{job_id}/logs",
        "GET /metrics",
        "GET /healthz",
    }


def sends_what_was_generated(case) -> bool:
    """A query parameter whose value is an empty list vanishes from the URL: a negative case that breaks the
    schema only with one (an unknown name, say) sends a valid request, rightly answered 200."""
    return not any(value == [] for value in (case.query or {}).values())


@pytest.mark.parametrize("operation,mode", CASES, ids=[f"{op.label} {mode.value}" for op, mode in CASES])
def test_no_server_errors_and_answers_as_documented(live, operation, mode):
    # A job spec has rules across fields that JSON Schema cannot state (learner gpus == nproc, group size
    # of group-based advantages, what the launcher can run): schema-valid specs may rightly get a 422.
    excluded = [positive_data_acceptance] if operation.label == "POST /v1/jobs" else []

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case):
        assume(mode is GenerationMode.POSITIVE or sends_what_was_generated(case))
        case.call_and_validate(
            base_url=live.url, headers={"Authorization": f"Bearer {TOKEN}"}, excluded_checks=excluded
        )

    check()
