-- kvgate PostgreSQL migration 0001: the usage ledger's durable copy.
--
-- Applied by `kvgate usage-sink` (src/usage_sink.rs) in one transaction, under an advisory
-- lock, when kvgate_schema.version is below 1. One row per ledger record; `id` is the record's
-- id, made by the gateway, so a record written twice (a sink restarted between its commit and
-- its acknowledgement) is one row.

CREATE TABLE usage_records (
    id                text        PRIMARY KEY,
    request_id        text        NOT NULL,
    tenant            text        NOT NULL,
    key_id            text        NOT NULL,
    model             text        NOT NULL,
    engine            text,
    prompt_tokens     bigint      NOT NULL,
    cached_tokens     bigint      NOT NULL,
    completion_tokens bigint      NOT NULL,
    cost_micros       bigint      NOT NULL,
    status            integer     NOT NULL,
    ending            text        NOT NULL,
    finish_reason     text,
    ttft_ms           bigint,
    duration_ms       bigint      NOT NULL,
    ended_at          timestamptz NOT NULL,
    -- The Redis stream entry it came from, and when the sink committed it.
    stream_id         text        NOT NULL,
    inserted_at       timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX usage_records_tenant_ended_at ON usage_records (tenant, ended_at);
CREATE INDEX usage_records_ended_at ON usage_records (ended_at);
