package idemclient_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idemstore/idem/idemclient"
)

// A client whose first attempt meets a failing gateway: the Transport sends
// the POST again with the same Idempotency-Key and body, and the caller only
// sees the final answer.
func Example() {
	var attempts atomic.Int32
	keys := make(chan string, 2)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		keys <- r.Header.Get("Idempotency-Key")
		if attempts.Add(1) == 1 {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":1}`)
	}))
	defer srv.Close()

	tr, err := idemclient.New(&idemclient.Config{MinBackoff: 10 * time.Millisecond})
	if err != nil {
		panic(err)
	}
	client := &http.Client{Transport: tr}

	// The context bounds the whole exchange, retries included. WithKey
	// would make the Transport use the caller's key (stored with the
	// business intent) instead of a new random one.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"sku":"tea"}`))
	if err != nil {
		panic(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)

	first, second := <-keys, <-keys
	fmt.Println(resp.StatusCode, string(body))
	fmt.Println("attempts:", attempts.Load(), "same key:", first == second, "key reported:", resp.Request.Header.Get("Idempotency-Key") == first)
	// Output:
	// 201 {"id":1}
	// attempts: 2 same key: true key reported: true
}
