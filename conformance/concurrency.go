package conformance

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

func concurrencyCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "ConcurrentDoOneKey", run: testConcurrentDoOneKey[TTx]},
		{name: "ConcurrentClaimOneKey", run: testConcurrentClaimOneKey[TTx]},
		{name: "ConcurrentManyKeysWithFailures", run: testConcurrentManyKeysWithFailures[TTx]},
	}
}

const goroutinesPerKey = 50

// testConcurrentDoOneKey starts 50 goroutines on one key at once, for
// several keys: exactly one runs the business effect, every other one gets
// the stored response or in-progress.
func testConcurrentDoOneKey[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 10 * time.Second, MaxTxRetries: 20})
	for round := range 4 {
		key := newKey(fmt.Sprintf("storm%d", round))
		var (
			wg       sync.WaitGroup
			mu       sync.Mutex
			winners  int
			replays  int
			inFlight int
			bad      []error
			calls    counter
		)
		startGun := make(chan struct{})
		for range goroutinesPerKey {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-startGun
				res, err := b.store.Do(ctx, "t1/create", key, fp("same"), orderFn(b.ns, key, &calls))
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil && !res.Replayed:
					winners++
				case err == nil:
					replays++
					if !equalResponse(orderResponse(key), res.Response) {
						bad = append(bad, errors.New("replayed a different response"))
					}
				case errors.Is(err, idem.ErrInProgress):
					inFlight++
				default:
					bad = append(bad, err)
				}
			}()
		}
		close(startGun)
		wg.Wait()
		require.Empty(t, bad, "unexplained outcomes in round %d", round)
		require.Equal(t, 1, winners, "round %d: %d replays, %d in progress", round, replays, inFlight)
		require.Equal(t, goroutinesPerKey, winners+replays+inFlight)
		require.Equal(t, 1, b.orders(ctx, t, key), "round %d: the business effect ran more than once", round)
	}
}

// testConcurrentClaimOneKey races pool-level claims, whose processing record
// commits at once: one acquires, all others see it in progress.
func testConcurrentClaimOneKey[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 10 * time.Second})
	key := newKey("claimstorm")
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		acquired int
		inFlight int
		bad      []error
	)
	startGun := make(chan struct{})
	for range goroutinesPerKey {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-startGun
			c, err := b.store.Claim(ctx, "t1/pay", key, fp("same"))
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil && c.Acquired():
				acquired++
			case errors.Is(err, idem.ErrInProgress):
				inFlight++
			default:
				bad = append(bad, fmt.Errorf("claim=%v err=%w", c, err))
			}
		}()
	}
	close(startGun)
	wg.Wait()
	require.Empty(t, bad)
	require.Equal(t, 1, acquired)
	require.Equal(t, goroutinesPerKey-1, inFlight)
}

var errFlaky = errors.New("flaky business failure")

// testConcurrentManyKeysWithFailures has workers retry many keys in random
// order while a quarter of the executions fail and roll back: a key whose
// execution failed runs again, and every key ends with exactly one order and
// one response that every worker saw.
func testConcurrentManyKeysWithFailures[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 10 * time.Second, MaxTxRetries: 20})
	const (
		workers = 12
		keys    = 15
	)
	keyNames := make([]string, keys)
	for i := range keyNames {
		keyNames[i] = newKey(fmt.Sprintf("many%02d", i))
	}
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		seen = map[string][]*idem.Response{}
		bad  []error
	)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 42)) //nolint:gosec // not security-sensitive: a reproducible key order per worker
			order := rng.Perm(keys)
			for _, i := range order {
				key := keyNames[i]
				for attempt := 0; ; attempt++ {
					if attempt > 200 {
						mu.Lock()
						bad = append(bad, fmt.Errorf("worker %d gave up on key %d", w, i))
						mu.Unlock()
						return
					}
					res, err := b.store.Do(ctx, "t1/create", key, fp("same"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
						if err := b.ns.InsertOrder(ctx, tx, key); err != nil {
							return nil, err
						}
						mu.Lock()
						fail := rng.IntN(4) == 0
						mu.Unlock()
						if fail {
							return nil, errFlaky
						}
						return orderResponse(key), nil
					})
					if errors.Is(err, errFlaky) || errors.Is(err, idem.ErrInProgress) || errors.Is(err, idem.ErrRetryable) {
						time.Sleep(time.Duration(1+rng.IntN(5)) * time.Millisecond)
						continue
					}
					mu.Lock()
					if err != nil {
						bad = append(bad, fmt.Errorf("worker %d key %d: %w", w, i, err))
					} else {
						seen[key] = append(seen[key], res.Response)
					}
					mu.Unlock()
					break
				}
			}
		}()
	}
	wg.Wait()
	require.Empty(t, bad)
	for _, key := range keyNames {
		require.Equal(t, 1, b.orders(ctx, t, key), "key %s", key)
		require.Len(t, seen[key], workers)
		for _, r := range seen[key] {
			requireSameResponse(t, orderResponse(key), r)
		}
	}
}

func equalResponse(a, b *idem.Response) bool {
	if a == nil || b == nil || a.StatusCode != b.StatusCode || string(a.Body) != string(b.Body) || len(a.Header) != len(b.Header) {
		return false
	}
	for k, v := range a.Header {
		w := b.Header[k]
		if len(v) != len(w) {
			return false
		}
		for i := range v {
			if v[i] != w[i] {
				return false
			}
		}
	}
	return true
}
