package mysql

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"time"

	"github.com/idemstore/idem"

	"github.com/idemstore/idem/migrations"
)

// Migrate applies idem's pending migrations to the database db is connected
// to, recording them in [migrations.VersionTable]. It does nothing when the
// schema is up to date, so it is safe to call at every start-up.
//
// Concurrent calls, from one process or many, on one server or on several
// nodes of a MariaDB Galera cluster, take turns. Two locks serialise them:
//
//   - the server lock GET_LOCK('idem_migrate'), held on a connection of its
//     own for the whole of goose's Up. The lock name is server-wide, so
//     migrations of different databases on one server take turns too. It
//     is local to one server: two Galera nodes grant it at once.
//   - a lease row in the table idem_migrate_lock of the migrated database,
//     which Migrate creates (CREATE TABLE IF NOT EXISTS, outside goose, like
//     goose's own version table) and in which it inserts the lease (row id 1)
//     before goose starts and deletes it after. A primary key can be
//     committed once across a cluster (the other node meets the row or fails
//     certification), so the lease serialises nodes. The holder renews it
//     every 5s to 30s from the database clock; one whose holder died is
//     taken over 30s after its last renewal. If a renewal fails (the lease
//     was lost, or the database did not answer) for 15s, goose's Up is
//     cancelled, so two migrators never run at once.
//
// goose's own session locker is not used for this: Up first checks for
// pending migrations without taking it, and on MySQL, whose DDL commits at
// once, a second caller could then see the version table created but not
// yet filled ("missing zero version migration"). A call waits for each lock
// up to 5 minutes, or until ctx ends.
//
// Errors from goose are returned unchanged, so a *goose.PartialError stays
// reachable with errors.As. MySQL commits each DDL statement implicitly;
// idem's migration files hold one statement each for that reason.
//
// The lock holds one connection while goose works on another, so db must
// allow at least two open connections; a pool limited to one is refused with
// [ErrMigrateSingleConn] rather than left to wait on itself, holding the
// server-wide lock, until ctx ends.
func Migrate(ctx context.Context, db *sql.DB) error {
	if db.Stats().MaxOpenConnections == 1 {
		return ErrMigrateSingleConn
	}
	p, err := migrations.NewProvider(migrations.MySQL, db)
	if err != nil {
		return err
	}
	conn, err := db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("idem: mysql: migrate: %w", interpretError(err))
	}
	defer conn.Close()
	var locker migrateLocker
	if err := locker.SessionLock(ctx, conn); err != nil {
		return err
	}
	defer func() { _ = locker.SessionUnlock(context.WithoutCancel(ctx), conn) }()
	lease, err := takeMigrateLease(ctx, db)
	if err != nil {
		return err
	}
	upCtx, cancel := context.WithCancelCause(ctx)
	renewed := make(chan struct{})
	go func() {
		defer close(renewed)
		lease.keep(upCtx, cancel)
	}()
	_, err = p.Up(upCtx)
	cancel(nil)
	<-renewed
	lease.release(context.WithoutCancel(ctx))
	if cause := context.Cause(upCtx); err != nil && errors.Is(cause, errMigrateLeaseLost) {
		return fmt.Errorf("%w: %w", cause, err)
	}
	return err
}

// ErrMigrateSingleConn is returned by [Migrate] for a pool limited to one
// open connection (sql.DB.SetMaxOpenConns(1)): the migration lock and goose
// need a connection each. Migrate with a pool that allows two or more, then
// limit it.
var ErrMigrateSingleConn = errors.New("idem: mysql: migrate needs a pool of at least 2 connections (SetMaxOpenConns(1) would deadlock on the migration lock)")

// migrateLocker takes and releases GET_LOCK on one connection.
type migrateLocker struct{}

const (
	migrateLockName    = "idem_migrate"
	migrateLockSeconds = 300
)

func (migrateLocker) SessionLock(ctx context.Context, conn *sql.Conn) error {
	// GET_LOCK returns 1 when granted, 0 on timeout, NULL on error.
	var granted sql.NullInt64
	if err := conn.QueryRowContext(ctx, getMigrateLock, migrateLockName, migrateLockSeconds).Scan(&granted); err != nil {
		return fmt.Errorf("idem: mysql: take migration lock %s: %w", migrateLockName, interpretError(err))
	}
	if granted.Int64 != 1 {
		return fmt.Errorf("idem: mysql: migration lock %s not granted within %ds", migrateLockName, migrateLockSeconds)
	}
	return nil
}

func (migrateLocker) SessionUnlock(ctx context.Context, conn *sql.Conn) error {
	// RELEASE_LOCK returns 1 when released, 0 or NULL when this session did
	// not hold it; either way the session holds no lock afterwards.
	var released sql.NullInt64
	if err := conn.QueryRowContext(ctx, releaseMigrateLock, migrateLockName).Scan(&released); err != nil {
		return fmt.Errorf("idem: mysql: release migration lock %s: %w", migrateLockName, interpretError(err))
	}
	return nil
}

const (
	// migrateLeaseSeconds is how long a lease lives after its last renewal.
	migrateLeaseSeconds = 30
	// migrateLeaseRenew is how often the holder renews it; after
	// migrateLeaseGrace without a renewal the holder gives up.
	migrateLeaseRenew = 5 * time.Second
	migrateLeaseGrace = 15 * time.Second
)

// errMigrateLeaseLost cancels goose's Up when the holder could not renew
// its lease: another migrator may take it over once it runs out.
var errMigrateLeaseLost = errors.New("idem: mysql: migrate: the migration lease could not be renewed; migration stopped")

// migrateLease is a lease row of migrateLeaseTable held by this call.
type migrateLease struct {
	db     *sql.DB
	holder []byte
}

// takeMigrateLease creates migrateLeaseTable if missing and inserts the
// lease, waiting while another migrator holds a live one.
func takeMigrateLease(ctx context.Context, db *sql.DB) (*migrateLease, error) {
	// Concurrent CREATE TABLE IF NOT EXISTS are safe: on one server the
	// second waits for the first's metadata lock; on Galera DDL is
	// replicated in total order (TOI) and the second finds the table.
	if _, err := db.ExecContext(ctx, createMigrateLeaseTable); err != nil {
		return nil, fmt.Errorf("idem: mysql: create %s: %w", migrateLeaseTable, interpretError(err))
	}
	holder := make([]byte, 16)
	_, _ = rand.Read(holder) // crypto/rand never fails on supported platforms
	holder = []byte(hex.EncodeToString(holder))
	deadline := time.Now().Add(migrateLockSeconds * time.Second)
	for {
		_, err := db.ExecContext(ctx, insertMigrateLease, holder, migrateLeaseSeconds)
		if err == nil {
			return &migrateLease{db: db, holder: holder}, nil
		}
		if !migrateLeaseBusy(err) {
			return nil, fmt.Errorf("idem: mysql: take migration lease: %w", interpretError(err))
		}
		// Held by another migrator. One that died leaves a lease that runs
		// out; delete it so the next insert can succeed.
		if _, err := db.ExecContext(ctx, deleteStaleMigrateLease); err != nil && !migrateLeaseBusy(err) {
			return nil, fmt.Errorf("idem: mysql: take over stale migration lease: %w", interpretError(err))
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("idem: mysql: migration lease in %s held by another migrator for %ds", migrateLeaseTable, migrateLockSeconds)
		}
		t := time.NewTimer(100*time.Millisecond + time.Duration(mrand.N(200))*time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("idem: mysql: take migration lease: %w", ctx.Err())
		case <-t.C:
		}
	}
}

// migrateLeaseBusy reports whether a lease statement failed because another
// migrator holds or is taking the lease: the row exists (1062), or, on
// Galera, another node committed it first (a certification failure, 1213).
func migrateLeaseBusy(err error) bool {
	return isDupEntry(err) || errors.Is(interpretError(err), idem.ErrRetryable)
}

// keep renews the lease until ctx ends, and cancels ctx with
// errMigrateLeaseLost when the lease is gone or has not been renewed for
// migrateLeaseGrace.
func (l *migrateLease) keep(ctx context.Context, cancel context.CancelCauseFunc) {
	tick := time.NewTicker(migrateLeaseRenew)
	defer tick.Stop()
	last := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		res, err := l.db.ExecContext(ctx, renewMigrateLease, migrateLeaseSeconds, l.holder)
		var n int64
		if err == nil {
			n, err = res.RowsAffected()
		}
		switch {
		case err == nil && n == 1:
			last = time.Now()
		case err == nil:
			cancel(errMigrateLeaseLost) // deleted as stale: another migrator may hold it
			return
		case time.Since(last) > migrateLeaseGrace:
			cancel(fmt.Errorf("%w: %w", errMigrateLeaseLost, interpretError(err)))
			return
		}
	}
}

// release deletes the lease. If that fails, the lease runs out
// migrateLeaseSeconds after its last renewal and the next migrator takes it
// over.
func (l *migrateLease) release(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, _ = l.db.ExecContext(ctx, releaseMigrateLease, l.holder)
}
