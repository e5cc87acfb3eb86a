DROP SCHEMA IF EXISTS idemexp CASCADE;
CREATE SCHEMA idemexp;
SET search_path = idemexp;
CREATE TABLE idempotency_keys (
    scope text NOT NULL, idempotency_key text NOT NULL, fingerprint bytea NOT NULL, status smallint NOT NULL,
    token bigint NOT NULL, attempt integer NOT NULL, lease_expires_at timestamptz NOT NULL,
    response_status integer, response_headers bytea, response_body bytea, created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL, completed_at timestamptz, expires_at timestamptz NOT NULL,
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (scope, idempotency_key));
CREATE INDEX ON idempotency_keys (expires_at);
CREATE INDEX ON idempotency_keys (lease_expires_at) WHERE status = 1;
CREATE FUNCTION idempotency_keys_digest(scope text, idempotency_key text) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT substring(sha256(convert_to(scope, 'UTF8') || '\x00'::bytea || convert_to(idempotency_key, 'UTF8')) FROM 1 FOR 8) $$;
CREATE INDEX ON idempotency_keys (idempotency_keys_digest(scope, idempotency_key));
CREATE TABLE biz (id bigserial primary key, k text not null, amount int not null, created_at timestamptz default now());
CREATE FUNCTION claim_read(p_scope text, p_key text) RETURNS SETOF idempotency_keys
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM idemexp.idempotency_keys WHERE scope = p_scope AND idempotency_key = p_key) THEN
    IF NOT pg_try_advisory_xact_lock(hashtextextended(p_key, hashtextextended(p_scope, 1))) THEN
      RETURN;
    END IF;
  END IF;
  RETURN QUERY SELECT * FROM idemexp.idempotency_keys WHERE scope = p_scope AND idempotency_key = p_key;
END $$;
CREATE FUNCTION claim_read_sql(p_scope text, p_key text, locked boolean) RETURNS SETOF idempotency_keys
LANGUAGE sql VOLATILE AS $$ SELECT * FROM idemexp.idempotency_keys WHERE scope = p_scope AND idempotency_key = p_key $$;
-- afterwards: DROP SCHEMA idemexp CASCADE;
