// Package idemwatermill is a Watermill router middleware that applies each
// message's effect at most once per message UUID, whatever the Pub/Sub
// redelivers, on top of an [idem.Store]: the handler runs in a transaction
// in which the message's key is claimed, its writes and the messages it
// produces are stored and committed together, and a redelivered message gets
// the stored produced messages again (same UUIDs, so downstream consumers
// deduplicate them too) without running the handler.
//
//	store, err := idem.New(idempg.New(pool), nil) // *idem.Store[pgx.Tx]
//	dedup, err := idemwatermill.Middleware(store, nil)
//	poison, err := middleware.PoisonQueueWithFilter(pub, "poison", idemwatermill.IsPermanent)
//	router.AddMiddleware(poison, dedup)
//	router.AddHandler("ledger", "credits", sub, "events", pub, func(msg *message.Message) ([]*message.Message, error) {
//		tx, _ := idemwatermill.Tx[pgx.Tx](msg.Context()) // the key is claimed in tx
//		// ... apply the credit on tx ...
//	})
//
// The key is the message UUID (Config.Key to choose another, such as a
// metadata value the publisher sets); the scope is the router handler's name
// (two handlers that must each apply a message have two names); the
// fingerprint is the payload, so a changed payload under a known UUID is
// refused with an error matching [idem.ErrFingerprint] and never applied.
// Outcomes, as the router sees them:
//
//   - the handler succeeds: its produced messages are stored (metadata and
//     payloads), the transaction commits, and only then does the router
//     publish them and ack;
//   - the handler fails (or panics): the transaction rolls back, nothing is
//     stored, and the error reaches the router, which nacks; the redelivery
//     runs the handler again. An error wrapping idem.ErrRetryable runs it
//     again at once, in a new transaction;
//   - a redelivery of a handled message: the stored messages are returned
//     (the router publishes them again, at least once), the handler does
//     not run;
//   - another consumer holds the message: an error matching
//     idem.ErrInProgress; nack (add middleware.Retry to wait);
//   - the store is unavailable: an error matching idem.ErrStoreUnavailable;
//     nothing ran, nack;
//   - a changed payload, an unusable key or a stored result that does not
//     decode: an error for which [IsPermanent] is true. A redelivery can
//     never succeed: route it to a poison queue with
//     middleware.PoisonQueueWithFilter(pub, topic, IsPermanent).
//
// The handler's effect must live in the store's database: outside effects
// need a committed lease ([idem.Store.Acquire]). A permanent rejection that
// must stand is recorded by the handler and answered with success (and no
// or some messages), so that it is stored and replayed like any result.
//
// Stored results follow the convention for results that are not HTTP
// responses (docs/integrations.md): StatusCode 200, header
// Message-Type "watermill.messages/v1", Body a JSON array of the produced
// messages (uuid, metadata, payload).
package idemwatermill

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemstore/idem"
)

// Config configures [Middleware]. A nil *Config, and every zero field, means
// the default.
type Config struct {
	// Key returns the idempotency key of a message. Defaults to its UUID.
	// An error, or a key idem refuses (empty, over idem.MaxKeyLength,
	// control characters), is permanent.
	Key func(msg *message.Message) (string, error)
	// Scope returns the scope a message's key is claimed in. Defaults to
	// the router handler's name (message.HandlerNameFromCtx), or "default"
	// outside a router.
	Scope func(msg *message.Message) (string, error)
	// Fingerprint returns the bytes that identify a message's request.
	// Defaults to the payload; metadata is left out because middlewares
	// (retries, poison queues, tracing) change it between deliveries.
	Fingerprint func(msg *message.Message) ([]byte, error)
	// MaxResultBytes bounds the stored encoding of the produced messages;
	// a larger result rolls back and fails permanently. Defaults to 1 MiB.
	MaxResultBytes int
	// Timeout bounds the transaction of a message, handler included. The
	// message's context cancellation does not end it once the key is
	// claimed: it runs to completion and commits, so the redelivery
	// replays. Defaults to 30s.
	Timeout time.Duration
}

const (
	resultType        = "watermill.messages/v1"
	headerMessageType = "Message-Type"
)

// ErrPermanent is matched by the errors of messages that no redelivery can
// ever handle: see [IsPermanent].
var ErrPermanent = errors.New("idemwatermill: message cannot be handled, redelivery will not help")

// IsPermanent reports whether err, returned by the middleware, means that
// redelivering the message is pointless: its payload changed under a known
// key (it also matches idem.ErrFingerprint), its key or scope is unusable,
// or its stored result cannot be decoded. Use it as the filter of
// middleware.PoisonQueueWithFilter.
func IsPermanent(err error) bool { return errors.Is(err, ErrPermanent) }

type permanent struct{ err error }

func (p *permanent) Error() string   { return p.err.Error() }
func (p *permanent) Unwrap() []error { return []error{ErrPermanent, p.err} }

// Middleware returns the router middleware over store. It returns an error if
// store is nil or cfg is invalid.
func Middleware[TTx any](store *idem.Store[TTx], cfg *Config) (message.HandlerMiddleware, error) {
	if store == nil {
		return nil, errors.New("idemwatermill: Middleware needs a store")
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.MaxResultBytes == 0 {
		c.MaxResultBytes = 1 << 20
	}
	if c.Timeout == 0 {
		c.Timeout = 30 * time.Second
	}
	if c.MaxResultBytes < 0 || c.Timeout < 0 {
		return nil, errors.New("idemwatermill: Config.MaxResultBytes and Config.Timeout must not be negative")
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			return handle(store, &c, h, msg)
		}
	}, nil
}

func handle[TTx any](store *idem.Store[TTx], c *Config, h message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	key, scope, hashed, err := identify(c, msg)
	if err != nil {
		return nil, &permanent{err: err}
	}
	orig := msg.Context()
	// Once claimed, the message's work runs to completion and commits, so
	// that its redelivery finds the stored result.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(orig), c.Timeout)
	defer cancel()
	var produced []*message.Message
	res, err := store.Do(ctx, scope, key, idem.NewFingerprint([]byte("idemwatermill/1"), hashed),
		func(ctx context.Context, tx TTx) (*idem.Response, error) {
			a := &attempt{tx: tx}
			msg.SetContext(context.WithValue(ctx, attemptKey{}, a))
			defer func() {
				a.ended.Store(true)
				msg.SetContext(orig)
			}()
			out, err := h(msg)
			if err != nil {
				return nil, err
			}
			produced = out
			return encode(out, c.MaxResultBytes)
		})
	switch {
	case err == nil && res.Replayed:
		// A result kept in the store's BodyStore is read back (and
		// checked) first; its inline body is empty.
		stored, lerr := store.LoadBody(ctx, res.Response)
		if errors.Is(lerr, idem.ErrCorruptRecord) {
			return nil, &permanent{err: fmt.Errorf("idemwatermill: stored result: %w", lerr)}
		}
		if lerr != nil {
			return nil, fmt.Errorf("idemwatermill: stored result: %w", lerr) // the body store is down: redelivered
		}
		out, derr := decode(stored)
		if derr != nil {
			return nil, &permanent{err: fmt.Errorf("idemwatermill: stored result: %w", derr)}
		}
		return out, nil
	case err == nil:
		return produced, nil
	case errors.Is(err, idem.ErrFingerprint), errors.Is(err, idem.ErrInvalidKey), errors.Is(err, idem.ErrInvalidScope), errors.Is(err, errTooLarge):
		return nil, &permanent{err: err}
	default:
		return nil, err
	}
}

// identify returns the key, scope and fingerprinted bytes of msg.
func identify(c *Config, msg *message.Message) (key, scope string, hashed []byte, err error) {
	key = msg.UUID
	if c.Key != nil {
		if key, err = c.Key(msg); err != nil {
			return "", "", nil, fmt.Errorf("idemwatermill: key: %w", err)
		}
	}
	scope = message.HandlerNameFromCtx(msg.Context())
	if scope == "" {
		scope = "default"
	}
	if c.Scope != nil {
		if scope, err = c.Scope(msg); err != nil {
			return "", "", nil, fmt.Errorf("idemwatermill: scope: %w", err)
		}
	}
	hashed = msg.Payload
	if c.Fingerprint != nil {
		if hashed, err = c.Fingerprint(msg); err != nil {
			return "", "", nil, fmt.Errorf("idemwatermill: fingerprint: %w", err)
		}
	}
	return key, scope, hashed, nil
}

var errTooLarge = errors.New("idemwatermill: produced messages too large to store")

// stored is one produced message as stored.
type stored struct {
	UUID     string            `json:"uuid"`
	Metadata map[string]string `json:"metadata,omitempty"`
	Payload  []byte            `json:"payload"`
}

func encode(out []*message.Message, maxBytes int) (*idem.Response, error) {
	list := make([]stored, 0, len(out))
	for _, m := range out {
		if m == nil {
			return nil, errors.New("idemwatermill: the handler produced a nil message")
		}
		list = append(list, stored{UUID: m.UUID, Metadata: m.Metadata, Payload: m.Payload})
	}
	body, err := json.Marshal(list)
	if err != nil {
		return nil, fmt.Errorf("idemwatermill: encode produced messages: %w", err)
	}
	if len(body) > maxBytes {
		return nil, errTooLarge
	}
	h := http.Header{}
	h.Set("Content-Type", "application/json")
	h.Set(headerMessageType, resultType)
	return &idem.Response{StatusCode: http.StatusOK, Header: h, Body: body}, nil
}

func decode(r *idem.Response) ([]*message.Message, error) {
	if r == nil || r.Header.Get(headerMessageType) != resultType {
		return nil, errors.New("not a " + resultType + " result")
	}
	var list []stored
	if err := json.Unmarshal(r.Body, &list); err != nil {
		return nil, err
	}
	out := make([]*message.Message, 0, len(list))
	for _, s := range list {
		m := message.NewMessage(s.UUID, s.Payload)
		for k, v := range s.Metadata {
			m.Metadata.Set(k, v)
		}
		out = append(out, m)
	}
	return out, nil
}

type attemptKey struct{}

type attempt struct {
	tx    any
	ended atomic.Bool
}

// Tx returns the business transaction of the message whose context is ctx
// (msg.Context() in the handler), typed as the store's transaction type. The
// key is claimed in it; run the handler's writes on it and never commit it.
// ok is false outside the middleware, after the handler returned, and when
// TTx is not the store's type.
func Tx[TTx any](ctx context.Context) (tx TTx, ok bool) {
	a, _ := ctx.Value(attemptKey{}).(*attempt)
	if a == nil || a.ended.Load() {
		return tx, false
	}
	tx, ok = a.tx.(TTx)
	return tx, ok
}
