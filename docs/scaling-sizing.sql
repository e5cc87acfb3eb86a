-- Sizing of idempotency_keys on PostgreSQL (docs/scaling.md, "Bytes"). Run on a database where
-- the orders service stored POST /orders records (the failover scenario's promoted standby):
--   bash .ci/pgfailover.sh bash -c 'go test -tags failover -count=1 ./internal/failovertest/ &&
--       psql -X -q "$IDEM_FAILOVER_STANDBY_URL" -f docs/scaling-sizing.sql'
-- It copies one real record a million times into a table of its own (dropped at the end), with
-- 36-character keys (UUID text) in random order and spread-out deadlines, then measures.
\pset footer off
SELECT count(*) AS records, round(avg(pg_column_size(k.*))) AS row_bytes,
	round(avg(octet_length(scope))) AS scope_bytes, round(avg(octet_length(idempotency_key))) AS key_bytes,
	round(avg(octet_length(response_headers))) AS header_bytes, round(avg(octet_length(response_body))) AS body_bytes
FROM idempotency_keys k
WHERE response_status = 201 AND scope LIKE 'tenant-% POST /orders';

CREATE TABLE idem_sizing (LIKE idempotency_keys INCLUDING ALL);
INSERT INTO idem_sizing
SELECT r.scope, md5(g::text)::uuid::text, r.fingerprint, r.status, r.token, r.attempt, r.lease_expires_at,
	r.response_status, r.response_headers, r.response_body, r.created_at, r.updated_at, r.completed_at,
	r.expires_at + g * interval '1 millisecond'
FROM (SELECT * FROM idempotency_keys WHERE response_status = 201 AND scope LIKE 'tenant-% POST /orders' LIMIT 1) r,
	generate_series(1, 1000000) g
ORDER BY random();
VACUUM ANALYZE idem_sizing;

SELECT 'table (heap)' AS relation, pg_size_pretty(pg_table_size('idem_sizing')) AS size,
	round(pg_table_size('idem_sizing') / 1e6) AS bytes_per_row
UNION ALL
SELECT i.indexrelid::regclass::text, pg_size_pretty(pg_relation_size(i.indexrelid)),
	round(pg_relation_size(i.indexrelid) / 1e6)
FROM pg_index i WHERE i.indrelid = 'idem_sizing'::regclass
UNION ALL
SELECT 'total', pg_size_pretty(pg_total_relation_size('idem_sizing')),
	round(pg_total_relation_size('idem_sizing') / 1e6);

DROP TABLE idem_sizing;
