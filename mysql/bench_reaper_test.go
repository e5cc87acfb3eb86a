package mysql_test

import (
	"context"
	"database/sql"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/testdb"
	idemmysql "github.com/idemstore/idem/mysql"
)

// BenchmarkDeleteExpired measures the dialect's DeleteExpired alone, back
// to back, on 100 000 expired records among 20 000 live ones: its rate, and,
// when the server runs on this machine (its pid file readable), the
// server's CPU per deleted row, purge included (sampled until InnoDB's
// history list is empty again). That CPU is what a reaper takes from the
// claims on a server whose cores they saturate; docs/performance.md turns
// it into a bound on the reaper target of issue 17.
func BenchmarkDeleteExpired(b *testing.B) {
	const expired, live = 100_000, 20_000
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
	name := testdb.Name()
	server := benchMySQLDB(b, base, "", 2)
	if _, err := server.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if _, err := server.ExecContext(context.Background(), "DROP DATABASE IF EXISTS "+name); err != nil {
			b.Error(err)
		}
	})
	db := benchMySQLDB(b, base, name, 2)
	if err := idemmysql.Migrate(ctx, db); err != nil {
		b.Fatal(err)
	}
	d := idemmysql.New(db)
	pid := serverPID(ctx, db)
	now := time.Now().UTC()
	for _, c := range []struct {
		name  string
		size  int
		alter string
	}{
		{"Batches100", 100, ""},
		{"Batches1000", 1000, ""},
		// Not a schema idem ships: what the digest index (migration 00003,
		// SHA2 of a virtual column per entry) costs the delete, last,
		// since it changes the table for good.
		{"Batches1000WithoutDigestIndex", 1000, `ALTER TABLE idempotency_keys DROP INDEX idempotency_keys_digest_idx`},
	} {
		size := c.size
		if c.alter != "" {
			if _, err := db.ExecContext(ctx, c.alter); err != nil {
				b.Fatal(err)
			}
		}
		b.Run(c.name, func(b *testing.B) {
			var rows int
			var elapsed, cpu time.Duration
			for range b.N {
				b.StopTimer()
				if _, err := db.ExecContext(ctx, `TRUNCATE TABLE idempotency_keys`); err != nil {
					b.Fatal(err)
				}
				for _, f := range []struct {
					prefix string
					n      int
					shift  time.Duration
				}{{"exp-", expired, -48 * time.Hour}, {"live-", live, 48 * time.Hour}} {
					if _, err := db.ExecContext(ctx, benchFillRecords, f.prefix, now, now, now, now, now.Add(f.shift), f.n); err != nil {
						b.Fatal(err)
					}
				}
				waitPurged(ctx, b, db)
				cpu0 := processCPU(pid)
				b.StartTimer()
				start := time.Now()
				n := 0
				for {
					got, err := d.DB().DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: size, Now: &now})
					if err != nil {
						b.Fatal(err)
					}
					n += got
					if got < size {
						break
					}
				}
				elapsed += time.Since(start)
				b.StopTimer()
				waitPurged(ctx, b, db)
				cpu += processCPU(pid) - cpu0
				if n != expired {
					b.Fatalf("deleted %d rows, want %d", n, expired)
				}
				rows += n
			}
			b.ReportMetric(float64(rows)/elapsed.Seconds(), "rows/s")
			if pid != "" {
				b.ReportMetric(float64(cpu.Microseconds())/float64(rows), "server-cpu-µs/row")
			}
		})
	}
}

// benchFillRecords inserts ?7 completed records of scope ?1||NN with random
// keys, expiring at ?6, from a cross join of digits (a recursive CTE would
// meet MariaDB's max_recursive_iterations).
const benchFillRecords = `INSERT INTO idempotency_keys (` + benchSeedColumns + `)
SELECT CONCAT(?, LPAD(g.n % 100, 2, '0')), MD5(CONCAT(RAND(), g.n)), RANDOM_BYTES(32), 2, 1, 1,
	?, 200, RANDOM_BYTES(40), RANDOM_BYTES(60), ?, ?, ?, ?
FROM (
	SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d + 100000 * h.d AS n
	FROM ` + digits + ` a, ` + digits + ` b, ` + digits + ` c, ` + digits + ` e, ` + digits + ` f, ` + digits + ` h
) g
WHERE g.n < ?`

const digits = `(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
	UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9)`

// serverPID returns the server's process id when its pid file is readable
// here, else "".
func serverPID(ctx context.Context, db *sql.DB) string {
	var file string
	if err := db.QueryRowContext(ctx, `SELECT @@pid_file`).Scan(&file); err != nil {
		return ""
	}
	pid, err := os.ReadFile(file)
	if err != nil {
		return ""
	}
	p := strings.TrimSpace(string(pid))
	if _, err := os.Stat("/proc/" + p + "/stat"); err != nil {
		return ""
	}
	return p
}

// processCPU returns the user and system CPU time process pid has used
// (clock ticks of 10 ms, Linux's USER_HZ), or 0 when pid is "".
func processCPU(pid string) time.Duration {
	if pid == "" {
		return 0
	}
	stat, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		return 0
	}
	// The command (field 2) may hold spaces; fields after it are counted
	// from its closing parenthesis: utime and stime are fields 14 and 15.
	rest := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	if len(rest) < 13 {
		return 0
	}
	utime, _ := strconv.ParseInt(rest[11], 10, 64)
	stime, _ := strconv.ParseInt(rest[12], 10, 64)
	return time.Duration(utime+stime) * 10 * time.Millisecond
}

// waitPurged waits, up to 30 s, until InnoDB has purged every deleted row
// (its history list is empty), so that the CPU of a purge falls in the
// measurement of the deletes that caused it.
func waitPurged(ctx context.Context, b *testing.B, db *sql.DB) {
	b.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		var name string
		var n int64
		if err := db.QueryRowContext(ctx, `SHOW STATUS LIKE 'Innodb_history_list_length'`).Scan(&name, &n); err != nil {
			return // MySQL names it otherwise; the purge then is not waited for
		}
		if n == 0 {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}
