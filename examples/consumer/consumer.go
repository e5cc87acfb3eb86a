package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/idemstore/idem"
)

// Message is one delivery of an at-least-once queue: the same ID may arrive
// any number of times (a lost ack, a consumer that crashed after its commit,
// a publisher that retried), and to several consumers at once.
type Message struct {
	// ID is the publisher's message ID, the idempotency key: stable across
	// redeliveries and publisher retries.
	ID string
	// Payload is the message body as published.
	Payload []byte
}

// Outcome tells what became of a message.
type Outcome int

const (
	// Applied: the effect committed, now or at an earlier delivery.
	Applied Outcome = iota + 1
	// Rejected: the message can never apply (an unknown account); the
	// rejection was recorded once, as a final failure, and is replayed to
	// every redelivery.
	Rejected
)

func (o Outcome) String() string {
	switch o {
	case Applied:
		return "applied"
	case Rejected:
		return "rejected"
	}
	return "unknown"
}

// Handled is what Handle reports of a message.
type Handled struct {
	Outcome Outcome
	// Replayed is true when the message was handled at an earlier
	// delivery: nothing was done now, and Result is the stored result.
	Replayed bool
	// Result is the handling's result, as JSON.
	Result []byte
}

// credit is the payload of the ledger's messages.
type credit struct {
	Account string `json:"account"`
	Cents   int64  `json:"cents"`
}

// errBadPayload reports a payload that does not decode; nothing is stored
// for it.
var errBadPayload = errors.New("consumer: payload is not a credit")

// Consumer applies ledger credits at most once per message ID, whatever the
// queue redelivers: the key is the message ID, the scope names the
// consumer (two consumers of one topic that must each apply a message use
// two scopes), and the fingerprint is the payload, so that a changed
// payload under a known ID is reported instead of applied or ignored.
type Consumer struct {
	store *idem.Store[*sql.Tx]
	scope string
}

// NewConsumer returns a consumer named name over store, whose database holds
// the accounts and entries tables.
func NewConsumer(store *idem.Store[*sql.Tx], name string) (*Consumer, error) {
	if store == nil || name == "" {
		return nil, errors.New("consumer: NewConsumer needs a store and a name")
	}
	return &Consumer{store: store, scope: "consumer " + name}, nil
}

// Handle applies m once: the entry, the new balance and the stored result
// commit in one transaction, or none of them does. On a redelivery it
// returns the first handling's result and does nothing.
//
// Errors: idem.ErrFingerprint (the ID was used with another payload: report
// it, never apply it), idem.ErrInvalidKey (an ID idem cannot key on), an
// *idem.InProgressError (another consumer holds the message: redeliver
// after its RetryAfter), idem.ErrStoreUnavailable and others (redeliver).
// [Decide] maps them to what the queue must do.
func (c *Consumer) Handle(ctx context.Context, m Message) (*Handled, error) {
	var cr credit
	if err := json.Unmarshal(m.Payload, &cr); err != nil || cr.Account == "" {
		return nil, errBadPayload
	}
	// The payload as published is the fingerprint: a publisher that
	// re-encodes on retry would need to hash the decoded fields instead.
	fp := idem.NewFingerprint([]byte("ledger-credit/1"), m.Payload)
	res, err := c.store.Do(ctx, c.scope, m.ID, fp, func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
		return apply(ctx, tx, m.ID, cr)
	})
	if err != nil {
		return nil, fmt.Errorf("consumer: message: %w", err)
	}
	h := &Handled{Outcome: Applied, Replayed: res.Replayed, Result: res.Response.Body}
	if res.Status == idem.StatusFailed {
		h.Outcome = Rejected
	}
	return h, nil
}

// apply credits the account on tx. A message for an unknown account is
// rejected for good: the rejection is stored as a final failure (committed,
// replayed), by the convention for results that are not HTTP responses:
// StatusCode 200 for a result, an HTTP-like 4xx for a final failure.
func apply(ctx context.Context, tx *sql.Tx, id string, cr credit) (*idem.Response, error) {
	res, err := tx.ExecContext(ctx, `UPDATE accounts SET balance = balance + ? WHERE name = ?`, cr.Cents, cr.Account)
	if err != nil {
		return nil, err
	}
	if n, err := res.RowsAffected(); err != nil {
		return nil, err
	} else if n == 0 {
		return nil, idem.FinalFailure(result(http.StatusUnprocessableEntity, map[string]any{"error": "unknown account"}))
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO entries (message_id, account, cents) VALUES (?, ?, ?)`, id, cr.Account, cr.Cents); err != nil {
		return nil, err
	}
	var balance int64
	if err := tx.QueryRowContext(ctx, `SELECT balance FROM accounts WHERE name = ?`, cr.Account).Scan(&balance); err != nil {
		return nil, err
	}
	return result(http.StatusOK, map[string]any{"account": cr.Account, "balance": balance}), nil
}

func result(code int, v map[string]any) *idem.Response {
	body, _ := json.Marshal(v) // a map of strings and numbers always marshals
	return &idem.Response{StatusCode: code, Header: http.Header{"Content-Type": {"application/json"}}, Body: body}
}

// Action is what a queue consumer loop does with a delivery.
type Action int

const (
	// Ack: done (applied now, or before); acknowledge the delivery.
	Ack Action = iota + 1
	// Retry: negatively acknowledge; the queue redelivers after the delay.
	Retry
	// DeadLetter: the message can never be applied as sent (a changed
	// payload under a known ID, an unusable ID or payload): move it aside
	// for a human, and acknowledge it.
	DeadLetter
)

func (a Action) String() string {
	switch a {
	case Ack:
		return "ack"
	case Retry:
		return "retry"
	case DeadLetter:
		return "dead-letter"
	}
	return "unknown"
}

// Decide maps the error of Handle to the queue's action and, for Retry, the
// delay before the redelivery.
func Decide(err error) (Action, time.Duration) {
	var inProgress *idem.InProgressError
	switch {
	case err == nil:
		return Ack, 0
	case errors.Is(err, idem.ErrFingerprint), errors.Is(err, idem.ErrInvalidKey), errors.Is(err, errBadPayload):
		return DeadLetter, 0
	case errors.As(err, &inProgress):
		return Retry, max(inProgress.RetryAfter, 100*time.Millisecond)
	default: // the store unavailable, a failed commit, an error of the effect
		return Retry, time.Second
	}
}
