package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/idemstore/idem/migrations"
)

// Migrate applies idem's pending migrations to the database db is connected
// to, recording them in [migrations.VersionTable]. It does nothing when the
// schema is up to date, so it is safe to call at every start-up.
//
// Concurrent calls, from one process or many, are serialised by the server
// lock GET_LOCK('idem_migrate'), held on a connection of its own for the
// whole of goose's Up. goose's own session locker is not used for this: Up
// first checks for pending migrations without taking it, and on MySQL, whose
// DDL commits at once, a second caller could then see the version table
// created but not yet filled ("missing zero version migration"). The lock
// name is server-wide, so migrations of different databases on one server
// take turns too. A call waits for the lock up to 5 minutes, or until ctx
// ends; the lock is released when Up ends or the connection closes.
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
	_, err = p.Up(ctx)
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
