package idem_test

import (
	"context"
	"errors"
	"fmt"
	"log"

	"github.com/idemstore/idem"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// ExampleStore_Check checks the store at start-up, then follows a key
// digest, as a log line prints it, to its record, and frees a lease whose
// holder is known dead.
func ExampleStore_Check() {
	db, cleanup := openExampleDB()
	defer cleanup()
	ctx := context.Background()
	store, err := idem.New(idemsqlite.New(db), nil)
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Check(ctx); err != nil {
		log.Fatal(err) // a *idem.CheckError names each problem and its fix
	}

	// A holder claims a payment and dies before completing it.
	held, err := store.Claim(ctx, "acme POST /payments", "pay-1", idem.NewFingerprint([]byte("1500")))
	if err != nil {
		log.Fatal(err)
	}
	digest := idem.KeyDigest("acme POST /payments", "pay-1") // what log lines carry
	recs, err := store.LookupDigest(ctx, digest)
	if err != nil {
		log.Fatal(err)
	}
	rec := recs[0]
	fmt.Println(rec.Status, rec.Token == held.Token)

	// Still in progress for everyone else; the lease is live, so a plain
	// Delete refuses.
	err = store.Delete(ctx, rec.Scope, rec.Key, nil)
	fmt.Println(errors.Is(err, idem.ErrLeaseLive))

	// After checking that the payment did not happen: release by token.
	if err := store.ReleaseLease(ctx, rec.Scope, rec.Key, rec.Token); err != nil {
		log.Fatal(err)
	}
	st, err := store.Stats(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(st.Total)
	// Output:
	// processing true
	// true
	// 0
}
