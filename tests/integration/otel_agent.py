"""A small instrumented agent: an ``openai`` client traced by a real instrumentation package, talking
to an OpenAI-compatible server, its spans and log records encoded with the real OTLP encoder.

Run as a script (it imports nothing from flywheel, so it also runs in a side virtual environment
that holds another version of an instrumentation package)::

    python otel_agent.py '{"base_url": ..., "model": ..., "instrumentation": "openai-v2" | "openinference",
                           "content": <env value or null>, "out": <dir>}'

With ``"otlp_endpoint"`` it also exports them with the real OTLP/HTTP exporters. It writes ``traces.pb`` and ``logs.pb`` (serialised ``ExportTraceServiceRequest`` /
``ExportLogsServiceRequest``, exactly what an OTLP/HTTP protobuf exporter sends) and prints one JSON
line describing each conversation it had (ids of the responses and tool calls), so the test can
compare what was ingested with what happened.

Conversations (each one trace; the agent wraps its turns in an ``invoke_agent`` span as agent
frameworks do, except the one-shot call, which is a trace of one span):

- ``weather``: system + user + tools -> the model calls ``get_weather`` -> the tool answers -> the
  model answers in text (two chat calls under one agent span);
- ``plain``: one user message, no tools, a text answer (a lone chat span: its own trace);
- ``error``: a request for a model the server does not serve (HTTP 404 -> an error span).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def main() -> None:
    args = json.loads(sys.argv[1])
    if args.get("content") is not None:
        os.environ[args.get("content_env", "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT")] = args["content"]
    for k, v in (args.get("env") or {}).items():
        os.environ[k] = v

    import opentelemetry.sdk._logs.export as log_export
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    # Renamed between SDK releases (InMemoryLogExporter -> InMemoryLogRecordExporter).
    mem_logs = getattr(log_export, "InMemoryLogRecordExporter", None) or log_export.InMemoryLogExporter
    resource = Resource.create({"service.name": "weather-agent"})
    tracer_provider = TracerProvider(resource=resource)
    spans = InMemorySpanExporter()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    logger_provider = LoggerProvider(resource=resource)
    logs = mem_logs()
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(logs))

    if args["instrumentation"] == "openinference":
        from openinference.instrumentation.openai import OpenAIInstrumentor

        instrumentor = OpenAIInstrumentor()
        instrumentor.instrument(tracer_provider=tracer_provider)
    else:
        from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

        instrumentor = OpenAIInstrumentor()
        instrumentor.instrument(tracer_provider=tracer_provider, logger_provider=logger_provider)

    import openai

    tracer = tracer_provider.get_tracer("weather-agent")
    client = openai.OpenAI(base_url=args["base_url"], api_key="unused", max_retries=0)
    model = args["model"]
    report: dict = {}

    # 1. a tool loop under one agent span
    with tracer.start_as_current_span("invoke_agent weather-agent") as agent:
        agent.set_attribute("gen_ai.operation.name", "invoke_agent")
        agent.set_attribute("gen_ai.agent.name", "weather-agent")
        messages = [{"role": "system", "content": "You answer weather questions."},
                    {"role": "user", "content": "What's the weather in Paris?"}]
        r1 = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], temperature=0.5,
                                            max_tokens=32, seed=7)
        msg = r1.choices[0].message
        calls = msg.tool_calls or []
        messages.append(msg.model_dump(exclude_none=True))
        for c in calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": '{"temperature_c": 21}'})
        r2 = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=32)
        report["weather"] = {
            "trace_id": format(agent.get_span_context().trace_id, "032x"),
            "response_ids": [r1.id, r2.id],
            "tool_calls": [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in calls],
            "finish_reasons": [r1.choices[0].finish_reason, r2.choices[0].finish_reason],
            "usage": [r1.usage.model_dump(), r2.usage.model_dump()],
            "answer": r2.choices[0].message.content,
        }

    # 2. a lone chat call (its own trace)
    r3 = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                        max_tokens=16, temperature=0.0)
    report["plain"] = {"response_ids": [r3.id], "answer": r3.choices[0].message.content,
                       "usage": [r3.usage.model_dump()], "finish_reasons": [r3.choices[0].finish_reason]}

    # 3. an error: the server does not serve this model
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi?"}])
        report["error"] = {"raised": None}
    except openai.NotFoundError as e:
        report["error"] = {"raised": type(e).__name__, "status": e.status_code}

    instrumentor.uninstrument()
    tracer_provider.force_flush()
    logger_provider.force_flush()

    from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    finished = spans.get_finished_spans()
    (out / "traces.pb").write_bytes(encode_spans(finished).SerializeToString())
    records = logs.get_finished_logs()
    (out / "logs.pb").write_bytes(encode_logs(records).SerializeToString() if records else b"")
    report["counts"] = {"spans": len(finished), "logs": len(records)}
    if args.get("otlp_endpoint"):
        # The real OTLP/HTTP protobuf exporters, as an agent configured with OTEL_EXPORTER_OTLP_ENDPOINT
        # uses them (spans gzip-compressed, logs plain).
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        ep = args["otlp_endpoint"].rstrip("/")
        res = OTLPSpanExporter(endpoint=f"{ep}/v1/traces", compression=Compression.Gzip).export(finished)
        report["exported"] = {"spans": res.name}
        if records and args.get("export_logs", True):
            report["exported"]["logs"] = OTLPLogExporter(endpoint=f"{ep}/v1/logs").export(records).name
    print(json.dumps(report))


if __name__ == "__main__":
    main()
