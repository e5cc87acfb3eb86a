package idem

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestReplayCacheDropsFillsOlderThanAForget(t *testing.T) {
	c := newReplayCache((&ReplayCacheConfig{}).withDefaults(time.Hour))
	now := time.Now()
	fp := NewFingerprint([]byte("a"))
	rec := &Record{Scope: "s", Key: "k", Fingerprint: fp, Status: StatusSucceeded, Response: &Response{StatusCode: 200, Body: []byte("x")}}

	before := c.gen()
	c.forget("s", "k", false) // a Delete that ran while the fill was computed
	c.put(rec, before, now.Add(time.Minute), now)
	require.Nil(t, c.get("s", "k", fp, now))

	c.put(rec, c.gen(), now.Add(time.Minute), now)
	require.NotNil(t, c.get("s", "k", fp, now))
	require.Nil(t, c.get("s", "k", NewFingerprint([]byte("b")), now))
	require.Nil(t, c.get("s", "k", fp, now.Add(time.Minute)), "dead at its deadline")
}

func TestReplayCacheBoundsBytes(t *testing.T) {
	c := newReplayCache(&ReplayCacheConfig{MaxEntries: 100, MaxBytes: 16 * 1024, MaxAge: time.Minute})
	now := time.Now()
	fp := NewFingerprint([]byte("a"))
	put := func(key string, n int) {
		c.put(&Record{Scope: "s", Key: key, Fingerprint: fp, Status: StatusSucceeded, Response: &Response{Body: make([]byte, n)}}, c.gen(), now.Add(time.Minute), now)
	}
	put("big", 2*1024) // above MaxBytes/16: never cached
	require.Nil(t, c.get("s", "big", fp, now))
	for i := range 40 {
		put(string(rune('a'+i)), 600)
	}
	require.LessOrEqual(t, c.bytes, int64(16*1024))
	require.NotNil(t, c.get("s", string(rune('a'+39)), fp, now), "the newest stays")
	require.Nil(t, c.get("s", "a", fp, now), "the oldest went")
	// A processing record, or one whose body is elsewhere, is never cached.
	c.put(&Record{Scope: "s", Key: "p", Fingerprint: fp, Status: StatusProcessing, Response: &Response{}}, c.gen(), now.Add(time.Minute), now)
	c.put(&Record{Scope: "s", Key: "r", Fingerprint: fp, Status: StatusSucceeded, Response: &Response{BodyRef: &BodyRef{}}}, c.gen(), now.Add(time.Minute), now)
	require.Nil(t, c.get("s", "p", fp, now))
	require.Nil(t, c.get("s", "r", fp, now))
}
