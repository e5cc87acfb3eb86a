package retryablehttp_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-retryablehttp"

	idemretryable "github.com/idemstore/idem/contrib/retryablehttp"
)

// A go-retryablehttp client that retries the 409 in progress with the same
// key, which the library's default policy returns as final.
func ExampleNewClient() {
	var attempts atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if attempts.Add(1) == 1 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusConflict)
			_, _ = io.WriteString(w, `{"code":"idempotency_request_in_progress","message":"…"}`)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":1}`)
	}))
	defer srv.Close()

	client := idemretryable.NewClient()
	client.RetryWaitMin = 10 * time.Millisecond
	client.HTTPClient.Timeout = 10 * time.Second // each attempt

	req, err := retryablehttp.NewRequest(http.MethodPost, srv.URL+"/transfers", strings.NewReader(`{"amount":100}`))
	if err != nil {
		panic(err)
	}
	if _, err := idemretryable.SetKey(req); err != nil { // once: every attempt sends it
		panic(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Println(resp.StatusCode, string(body), "after", attempts.Load(), "attempts")
	// Output: 201 {"id":1} after 2 attempts
}
