package mysql_test

import (
	"context"
	"database/sql"
	"encoding/hex"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/testdb"
	idemmysql "github.com/idemstore/idem/mysql"
)

// BenchmarkClaimLargeTable measures claim+complete (ClaimTx and CompleteTx
// in one transaction, no business write) at 8 goroutines on an empty table
// and on one prefilled with IDEM_BENCH_ROWS completed records (for example
// 1000000), to see whether the claim slows down once the clustered index
// outgrows the buffer pool. It is skipped unless IDEM_BENCH_ROWS is set:
// the prefill takes minutes. IDEM_BENCH_MYSQL_LAYOUT=surrogate alters the
// table after migrating it to a surrogate AUTO_INCREMENT primary key with a
// UNIQUE (scope, idempotency_key) index, the layout this benchmark exists to
// compare. See docs/performance.md.
func BenchmarkClaimLargeTable(b *testing.B) {
	rows, _ := strconv.Atoi(os.Getenv("IDEM_BENCH_ROWS"))
	if rows <= 0 {
		b.Skip("IDEM_BENCH_ROWS not set")
	}
	ctx := context.Background()
	dsn := testdb.MySQLDSN(b, func(dsn string) (string, error) {
		cfg, err := gomysql.ParseDSN(dsn)
		if err != nil {
			return "", err
		}
		return cfg.Addr, nil
	})
	base, err := gomysql.ParseDSN(dsn)
	if err != nil {
		b.Fatal(err)
	}
	for _, n := range []int{0, rows} {
		b.Run("rows="+strconv.Itoa(n), func(b *testing.B) {
			db := largeTableDB(ctx, b, base, n)
			store, err := idem.New(idemmysql.New(db), nil)
			if err != nil {
				b.Fatal(err)
			}
			resp := &idem.Response{StatusCode: 201, Body: []byte(`{"ok":true}`)}
			fp := idem.NewFingerprint([]byte("large"))
			b.ReportAllocs()
			b.SetParallelism(4)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				var raw [16]byte
				for pb.Next() {
					for i := range raw {
						raw[i] = byte(rand.Uint32()) //nolint:gosec // benchmark keys only need to be distinct
					}
					scope, key := "tenant-"+strconv.Itoa(rand.IntN(100)), hex.EncodeToString(raw[:]) //nolint:gosec // workload randomness
					tx, err := db.BeginTx(ctx, nil)
					if err != nil {
						b.Error(err)
						return
					}
					c, err := store.ClaimTx(ctx, tx, scope, key, fp)
					if err == nil {
						err = store.CompleteTx(ctx, tx, c, resp)
					}
					if err == nil {
						err = tx.Commit()
					}
					if err != nil {
						_ = tx.Rollback()
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

// largeTableDB returns a pool of 8 connections on a new, migrated database
// holding n completed records with random-looking keys over 100 scopes,
// dropped when b ends.
func largeTableDB(ctx context.Context, b *testing.B, base *gomysql.Config, n int) *sql.DB {
	b.Helper()
	name := testdb.Name()
	server := benchMySQLDB(b, base, "", 1)
	if _, err := server.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if _, err := server.ExecContext(context.WithoutCancel(ctx), "DROP DATABASE IF EXISTS "+name); err != nil {
			b.Error(err)
		}
	})
	db := benchMySQLDB(b, base, name, 8)
	if err := idemmysql.Migrate(ctx, db); err != nil {
		b.Fatal(err)
	}
	if os.Getenv("IDEM_BENCH_MYSQL_LAYOUT") == "surrogate" {
		if _, err := db.ExecContext(ctx, `ALTER TABLE idempotency_keys DROP PRIMARY KEY,
			ADD COLUMN id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT PRIMARY KEY FIRST,
			ADD UNIQUE KEY idempotency_keys_key_uq (scope, idempotency_key)`); err != nil {
			b.Fatal(err)
		}
	}
	if n > 0 {
		// Key order, so the prefill itself is a fast sequential load; the
		// measured claims then insert at random places. seq_1_to_N is
		// MariaDB's Sequence engine.
		//nolint:gosec // G202: n is an int from IDEM_BENCH_ROWS, parsed; a table name cannot be a parameter
		_, err := db.ExecContext(ctx, `INSERT INTO idempotency_keys (scope, idempotency_key, fingerprint,
				status, token, attempt, lease_expires_at, response_status, response_headers, response_body,
				created_at, updated_at, completed_at, expires_at)
			SELECT CONCAT('tenant-', seq % 100), MD5(seq), UNHEX(SHA2(seq, 256)), 2, seq, 1,
				UTC_TIMESTAMP(6), 201, '{"Content-Type":["application/json"]}', REPEAT('x', 194),
				UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 DAY
			FROM seq_1_to_`+strconv.Itoa(n)+`
			ORDER BY 1, 2`)
		if err != nil {
			b.Fatal(err)
		}
	}
	if _, err := db.ExecContext(ctx, `ANALYZE TABLE idempotency_keys`); err != nil {
		b.Fatal(err)
	}
	return db
}
