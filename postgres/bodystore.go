package postgres

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/bodytable"
)

// TableBodyStore is an [idem.TxBodyStore] in the idempotency_bodies table
// (migration 00004) of the database of the store's records: set it as
// Config.BodyStore of a Store over the same pool, and a body too large for
// its record is written, as rows of at most ChunkSize bytes, inside the
// transaction that commits the record ([idem.Store.Do]'s, or the caller's
// for CompleteTx), so that a rollback leaves nothing. On the pool (Put) it
// writes the object in a transaction of its own, which holds its row
// locks while it reads the body: pass a reader that does not wait on
// others (a file, a buffer). Reads fetch one row at a time. Create it with
// [NewTableBodyStore]; it is safe for concurrent use.
type TableBodyStore struct {
	pool *pgxpool.Pool
	cfg  bodytable.Config
	st   bodyStatements
}

var _ idem.TxBodyStore[pgx.Tx] = (*TableBodyStore)(nil)

type bodyStatements struct {
	insert, fetch, del, page string
}

func newBodyStatements(schema string) bodyStatements {
	table := "idempotency_bodies"
	if schema != "" {
		table = pgx.Identifier{schema, table}.Sanitize()
	}
	return bodyStatements{
		insert: `INSERT INTO ` + table + ` (address, seq, data, written_at) VALUES ($1::text, $2::bigint, $3::bytea, $4::timestamptz)`,
		fetch:  `SELECT data FROM ` + table + ` WHERE address = $1::text AND seq = $2::bigint`,
		del:    `DELETE FROM ` + table + ` WHERE address = $1::text`,
		page: `SELECT address FROM ` + table + ` WHERE seq = 0 AND written_at < $1::timestamptz AND address > $2::text
			ORDER BY address LIMIT $3::bigint`,
	}
}

// NewTableBodyStore returns a TableBodyStore on pool; cfg may be nil.
// Pass the [WithSchema] given to [New] and [Migrate]. An invalid option or
// configuration is an error matching [idem.ErrMisconfigured].
func NewTableBodyStore(pool *pgxpool.Pool, cfg *idem.TableBodyStoreConfig, opts ...Option) (*TableBodyStore, error) {
	o := applyOptions(opts)
	var c idem.TableBodyStoreConfig
	if cfg != nil {
		c = *cfg
	}
	bc, err := bodytable.NewConfig(c.ChunkSize, c.Now)
	if err != nil {
		err = fmt.Errorf("%w: idem: postgres: table body store: %w", idem.ErrMisconfigured, err)
	}
	if o.err != nil {
		err = o.err
	}
	if err != nil {
		return nil, err
	}
	return &TableBodyStore{pool: pool, cfg: bc, st: newBodyStatements(o.schema)}, nil
}

// Put implements [idem.BodyStore], in a transaction of its own.
func (b *TableBodyStore) Put(ctx context.Context, name string, r io.Reader) (string, error) {
	tx, err := b.pool.Begin(ctx)
	if err != nil {
		return "", interpretError(ctx, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	addr, err := b.PutTx(ctx, tx, name, r)
	if err != nil {
		return "", err
	}
	if err := tx.Commit(ctx); err != nil {
		return "", interpretError(ctx, err)
	}
	return addr, nil
}

// PutTx implements [idem.TxBodyStore]: the rows are written in tx, which
// an error leaves aborted.
func (b *TableBodyStore) PutTx(ctx context.Context, tx pgx.Tx, name string, r io.Reader) (string, error) {
	if tx == nil {
		return "", errNilTx
	}
	addr, err := bodytable.NewAddress(name)
	if err != nil {
		return "", err
	}
	at := b.cfg.WrittenAt()
	err = bodytable.Write(ctx, b.cfg, r, func(seq int64, data []byte) error {
		_, err := tx.Exec(ctx, b.st.insert, addr, seq, data, at)
		return interpretError(ctx, err)
	})
	if err != nil {
		return "", err
	}
	return addr, nil
}

// Open implements [idem.BodyStore]: the reader fetches one row per chunk,
// on the pool, with ctx.
func (b *TableBodyStore) Open(ctx context.Context, address string) (io.ReadCloser, error) {
	if !bodytable.ValidAddress(address) {
		return nil, bodytable.ErrNotExist
	}
	return bodytable.Open(ctx, func(ctx context.Context, seq int64, buf []byte) ([]byte, bool, error) {
		data := buf[:0]
		err := b.pool.QueryRow(ctx, b.st.fetch, address, seq).Scan(&data)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, false, nil
		}
		if err != nil {
			return nil, false, interpretError(ctx, err)
		}
		return data, true, nil
	})
}

// Delete implements [idem.BodyStore].
func (b *TableBodyStore) Delete(ctx context.Context, address string) error {
	if !bodytable.ValidAddress(address) {
		return nil
	}
	_, err := b.pool.Exec(ctx, b.st.del, address)
	return interpretError(ctx, err)
}

// List implements [idem.BodyStore], a page of addresses at a time.
func (b *TableBodyStore) List(ctx context.Context, writtenBefore time.Time, fn func(address string) error) error {
	return bodytable.List(ctx, func(ctx context.Context, after string, limit int) ([]string, error) {
		rows, err := b.pool.Query(ctx, b.st.page, writtenBefore.UTC(), after, limit)
		if err != nil {
			return nil, interpretError(ctx, err)
		}
		addrs, err := pgx.CollectRows(rows, pgx.RowTo[string])
		return addrs, interpretError(ctx, err)
	}, fn)
}
