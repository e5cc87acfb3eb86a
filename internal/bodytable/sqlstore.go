package bodytable

import (
	"context"
	"database/sql"
	"errors"
	"io"
	"time"
)

// SQLStore is the table body store over database/sql, for the dialects
// whose transaction is a *sql.Tx (mysql, sqlite): they give it their
// statements, their encoding of written_at and their error classifier.
type SQLStore struct {
	DB  *sql.DB
	Cfg Config
	// Insert takes (address, seq, data, written_at); Fetch (address, seq)
	// and returns data; Delete (address); Page (written_at bound, after,
	// limit) and returns addresses in order.
	Insert, Fetch, Delete, Page string
	// Time encodes a written_at value as the column holds it.
	Time func(time.Time) any
	// Classify translates a driver error (the dialect's interpretError).
	Classify func(error) error
}

var errNilTx = errors.New("idem: table body store: nil *sql.Tx")

// Put writes the object in a transaction of its own.
func (s *SQLStore) Put(ctx context.Context, name string, r io.Reader) (string, error) {
	tx, err := s.DB.BeginTx(ctx, nil)
	if err != nil {
		return "", s.Classify(err)
	}
	defer func() { _ = tx.Rollback() }()
	addr, err := s.PutTx(ctx, tx, name, r)
	if err != nil {
		return "", err
	}
	if err := tx.Commit(); err != nil {
		return "", s.Classify(err)
	}
	return addr, nil
}

// PutTx writes the object's rows in tx.
func (s *SQLStore) PutTx(ctx context.Context, tx *sql.Tx, name string, r io.Reader) (string, error) {
	if tx == nil {
		return "", errNilTx
	}
	addr, err := NewAddress(name)
	if err != nil {
		return "", err
	}
	at := s.Time(s.Cfg.WrittenAt())
	err = Write(ctx, s.Cfg, r, func(seq int64, data []byte) error {
		_, err := tx.ExecContext(ctx, s.Insert, addr, seq, data, at)
		return s.Classify(err)
	})
	if err != nil {
		return "", err
	}
	return addr, nil
}

// Open reads the object a row at a time, on the pool.
func (s *SQLStore) Open(ctx context.Context, address string) (io.ReadCloser, error) {
	if !ValidAddress(address) {
		return nil, ErrNotExist
	}
	return Open(ctx, func(ctx context.Context, seq int64, buf []byte) ([]byte, bool, error) {
		data, found, err := s.fetch(ctx, address, seq, buf)
		return data, found, s.Classify(err)
	})
}

// fetch reads one row into buf through sql.RawBytes, so that the row is
// copied once, into a buffer reused row after row.
func (s *SQLStore) fetch(ctx context.Context, address string, seq int64, buf []byte) ([]byte, bool, error) {
	rows, err := s.DB.QueryContext(ctx, s.Fetch, address, seq)
	if err != nil {
		return nil, false, err
	}
	defer rows.Close()
	if !rows.Next() {
		return nil, false, rows.Err()
	}
	var raw sql.RawBytes
	if err := rows.Scan(&raw); err != nil {
		return nil, false, err
	}
	data := append(buf[:0], raw...)
	return data, true, rows.Close()
}

// DeleteObject deletes every row of the object.
func (s *SQLStore) DeleteObject(ctx context.Context, address string) error {
	if !ValidAddress(address) {
		return nil
	}
	_, err := s.DB.ExecContext(ctx, s.Delete, address)
	return s.Classify(err)
}

// List pages through the objects written before writtenBefore.
func (s *SQLStore) List(ctx context.Context, writtenBefore time.Time, fn func(string) error) error {
	bound := s.Time(writtenBefore.UTC())
	return List(ctx, func(ctx context.Context, after string, limit int) ([]string, error) {
		rows, err := s.DB.QueryContext(ctx, s.Page, bound, after, limit)
		if err != nil {
			return nil, s.Classify(err)
		}
		defer rows.Close()
		var out []string
		for rows.Next() {
			var a string
			if err := rows.Scan(&a); err != nil {
				return nil, s.Classify(err)
			}
			out = append(out, a)
		}
		return out, s.Classify(rows.Err())
	}, fn)
}
