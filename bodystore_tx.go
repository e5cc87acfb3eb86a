package idem

import (
	"context"
	"io"
	"time"
)

// TxBodyStore is implemented, optionally, by a [BodyStore] that keeps its
// objects in the store's own database: the table stores of packages
// postgres, mysql and sqlite (NewTableBodyStore), over the idempotency_bodies
// table of migration 00004. The [Store] finds it by a type assertion for its
// transaction type TTx, and then writes a body inside the transaction its
// completion runs in, [Store.Do]'s own or the caller's (CompleteTx, FailTx,
// [Store.PutBodyTx]): the body commits with the record and the business
// rows, or, if the transaction rolls back, nothing of it is left, so that
// path makes no orphans. Completions on the pool (Complete, Fail, leased
// completions, status-check verdicts, [Store.PutBody]) use Put as with any
// BodyStore: the object commits on its own before the record, and a crash
// in between leaves an orphan for [Store.SweepBodies].
type TxBodyStore[TTx any] interface {
	BodyStore
	// PutTx is Put inside tx: the object becomes visible, and durable,
	// when tx commits, and vanishes if tx rolls back. It must never commit
	// or roll back tx, and reads r in the caller's goroutine, with tx
	// otherwise idle; an error may leave tx aborted (PostgreSQL), and the
	// caller then rolls it back. The naming rules of Put apply.
	PutTx(ctx context.Context, tx TTx, name string, r io.Reader) (address string, err error)
}

// put writes an object through Put, or through PutTx inside *tx when the
// BodyStore is a TxBodyStore[TTx]; inTx reports which.
func (s *Store[TTx]) put(ctx context.Context, tx *TTx, name string, r io.Reader) (addr string, inTx bool, err error) {
	if tx != nil {
		if ts, ok := s.cfg.BodyStore.(TxBodyStore[TTx]); ok {
			addr, err = ts.PutTx(ctx, *tx, name, r)
			return addr, true, err
		}
	}
	addr, err = s.cfg.BodyStore.Put(ctx, name, r)
	return addr, false, err
}

// PutBodyTx is [Store.PutBody] inside the transaction tx the claim c will
// be completed in (a Do callback's, or the caller's for CompleteTx): with a
// [TxBodyStore] the object is written in tx and commits, or rolls back,
// with it; with any other BodyStore it is PutBody. r is read in the
// caller's goroutine, and tx must not be used by another goroutine
// meanwhile. Errors are those of PutBody; after one, roll tx back.
func (s *Store[TTx]) PutBodyTx(ctx context.Context, tx TTx, c *Claim, r io.Reader) (*BodyRef, error) {
	if err := validateClaim(c); err != nil {
		return nil, err
	}
	return s.putBody(ctx, &tx, c.Scope, c.Key, c.Token, r)
}

// BodyStoreInTx reports whether the store's BodyStore writes bodies inside
// the completion's transaction (a [TxBodyStore] of the store's transaction
// type): for a caller such as idemhttp, which must then hand it the whole
// body once the transaction is otherwise idle ([Store.PutBodyTx]) instead
// of streaming it from another goroutine while the handler runs.
func (s *Store[TTx]) BodyStoreInTx() bool {
	_, ok := s.cfg.BodyStore.(TxBodyStore[TTx])
	return ok
}

// TableBodyStoreConfig configures the table body stores of packages
// postgres, mysql and sqlite (NewTableBodyStore). The zero value, or nil,
// takes every default.
type TableBodyStoreConfig struct {
	// ChunkSize is the most body bytes in one row: a put holds one chunk
	// in memory, a read one chunk per open reader. Between 1 KiB and
	// 4 MiB; on MySQL a chunk must fit max_allowed_packet with room to
	// spare. Defaults to 256 KiB.
	ChunkSize int
	// Now is the clock of the time an object was written, which
	// [Store.SweepBodies] compares with its own clock (time.Now) minus the
	// grace period. Defaults to time.Now.
	Now func() time.Time
}
