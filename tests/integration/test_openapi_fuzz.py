"""Schema-driven fuzzing of the server's own OpenAPI document (``/openapi.json``) on the real server.

Every operation the document lists is called with requests generated from it (positive and negative
modes: query, headers, path, and bodies where the document describes one), a few examples each. The
checks: no answer is a 5xx, and an answer's content type and body conform to what the document
declares for it.

The native and OpenAI routes read their bodies by hand (``parse_body``), so the document describes
no request body for them: the generated calls reach those routes without one (each must be a 4xx or
a 200), and hostile bodies are the job of ``test_fuzz_api``.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

CHECKS = [not_a_server_error, content_type_conformance, response_schema_conformance]
EXAMPLES = settings(max_examples=4, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_openapi_operations_answer_as_documented_and_never_5xx(server):
    """All operations are fuzzed; the failures of all of them are reported together."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", timeout=30)
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15, [op.label for op in operations]
    for operation in operations:
        # a negative case breaks a declared input; an operation that declares none has none to break
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if _declares_inputs(operation) else [])
        for mode in modes:

            @EXAMPLES
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)

            try:
                run()
            except Exception as exc:  # one operation's failure must not hide the next one's
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    assert not failures, "\n\n".join(failures)


def _declares_inputs(operation) -> bool:
    parts = ("path_parameters", "headers", "cookies", "query", "body")
    return any(len(getattr(operation, part)) for part in parts)
