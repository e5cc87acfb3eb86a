package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/bodytable"
)

// TableBodyStore is an [idem.TxBodyStore] in the idempotency_bodies table
// (migration 00004) of the database of the store's records: set it as
// Config.BodyStore of a Store over the same *sql.DB, and a body too large
// for its record is written, as rows of at most ChunkSize bytes, inside
// the transaction that commits the record ([idem.Store.Do]'s, or the
// caller's for CompleteTx), so that a rollback leaves nothing. On the pool
// (Put) it writes the object in a transaction of its own, held while it
// reads the body: pass a reader that does not wait on others (a file, a
// buffer). Reads fetch one row at a time. Create it with
// [NewTableBodyStore]; it is safe for concurrent use.
type TableBodyStore struct {
	s bodytable.SQLStore
}

var _ idem.TxBodyStore[*sql.Tx] = (*TableBodyStore)(nil)

const (
	bodyInsert = `INSERT INTO idempotency_bodies (address, seq, data, written_at) VALUES (?, ?, ?, ?)`
	bodyFetch  = `SELECT data FROM idempotency_bodies WHERE address = ? AND seq = ?`
	bodyDelete = `DELETE FROM idempotency_bodies WHERE address = ?`
	bodyPage   = `SELECT address FROM idempotency_bodies WHERE seq = 0 AND written_at < ? AND address > ?
	ORDER BY address LIMIT ?`
)

// NewTableBodyStore returns a TableBodyStore on db, the *sql.DB of the
// Dialect; cfg may be nil. An invalid configuration is an error matching
// [idem.ErrMisconfigured].
func NewTableBodyStore(db *sql.DB, cfg *idem.TableBodyStoreConfig) (*TableBodyStore, error) {
	var c idem.TableBodyStoreConfig
	if cfg != nil {
		c = *cfg
	}
	bc, err := bodytable.NewConfig(c.ChunkSize, c.Now)
	if err != nil {
		return nil, fmt.Errorf("%w: idem: sqlite: table body store: %w", idem.ErrMisconfigured, err)
	}
	return &TableBodyStore{s: bodytable.SQLStore{
		DB: db, Cfg: bc,
		Insert: bodyInsert, Fetch: bodyFetch, Delete: bodyDelete, Page: bodyPage,
		Time:     func(t time.Time) any { return micros(t) },
		Classify: func(err error) error { return interpretError(err) },
	}}, nil
}

// Put implements [idem.BodyStore], in a transaction of its own.
func (b *TableBodyStore) Put(ctx context.Context, name string, r io.Reader) (string, error) {
	return b.s.Put(ctx, name, r)
}

// PutTx implements [idem.TxBodyStore]: the rows are written in tx.
func (b *TableBodyStore) PutTx(ctx context.Context, tx *sql.Tx, name string, r io.Reader) (string, error) {
	return b.s.PutTx(ctx, tx, name, r)
}

// Open implements [idem.BodyStore]: the reader fetches one row per chunk,
// on the pool, with ctx.
func (b *TableBodyStore) Open(ctx context.Context, address string) (io.ReadCloser, error) {
	return b.s.Open(ctx, address)
}

// Delete implements [idem.BodyStore].
func (b *TableBodyStore) Delete(ctx context.Context, address string) error {
	return b.s.DeleteObject(ctx, address)
}

// List implements [idem.BodyStore], a page of addresses at a time.
func (b *TableBodyStore) List(ctx context.Context, writtenBefore time.Time, fn func(address string) error) error {
	return b.s.List(ctx, writtenBefore, fn)
}
