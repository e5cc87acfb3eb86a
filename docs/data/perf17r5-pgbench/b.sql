\set k random(1, 9000000000000000000)
BEGIN;
SELECT * FROM idemexp.claim_read('s', :k::text);
INSERT INTO idemexp.biz (k, amount) VALUES (:k::text, 1);
INSERT INTO idemexp.idempotency_keys (scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at, response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at) VALUES ('s', :k::text, '\x0000000000000000000000000000000000000000000000000000000000000000'::bytea, 2, 1, 1, now(), 200, '\x00'::bytea, '\x00'::bytea, now(), now(), now(), now() + interval '1 day');
COMMIT;
