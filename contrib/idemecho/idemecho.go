// Package idemecho runs idemhttp's Idempotency-Key middleware on echo (v4).
//
// echo takes net/http middleware through echo.WrapMiddleware, and
// idemhttp's Middleware.Wrap fits it, but an echo handler answers a failure
// by returning an error that echo renders after the middleware chain has
// returned: through WrapMiddleware idemhttp sees a handler that wrote
// nothing, so (since idemhttp refuses to store such an answer) the client
// gets 500 idempotency_handler_no_response instead of the handler's 404 or
// 422. [Middleware] is WrapMiddleware with the returned error rendered
// (echo's HTTPErrorHandler) inside the transaction, where idemhttp
// captures it: a 4xx or 5xx rolls back and passes through, as in net/http.
// It also runs the handler again, with a fresh request and response, when
// idemhttp retries the transaction (echo can call a handler twice, unlike
// gin), and leaves c.Request() and c.Response() as they were once it
// returns, so middlewares outside it see what was sent.
//
//	mw, err := idemhttp.New(store, &idemhttp.Config{Operation: idemecho.Operation})
//	e := echo.New()
//	g := e.Group("/v1", idemecho.Middleware(mw.Wrap))
//	g.POST("/orders", func(c echo.Context) error {
//		tx, _ := mw.Tx(c.Request().Context()) // the key is claimed in tx
//		// INSERT the order on tx
//		return c.JSON(http.StatusCreated, order)
//	})
package idemecho

import (
	"context"
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/idemstore/idem/idemhttp"
)

type routeKey struct{}

// Middleware returns mw (an idemhttp Middleware's Wrap) as echo middleware.
// Put it in e.Use, a group's middleware or a route's, not in e.Pre: it needs
// the route echo found (for [Operation]).
func Middleware(mw func(http.Handler) http.Handler) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			origReq, origResp := c.Request(), c.Response()
			var passErr error
			h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				c.SetRequest(r)
				if w == http.ResponseWriter(origResp) {
					// Passed through unprotected (another method, or no
					// key where Config.KeyOptional allows it): echo
					// renders the error as it always does.
					passErr = next(c)
					return
				}
				c.SetResponse(echo.NewResponse(w, c.Echo()))
				if err := next(c); err != nil {
					c.Error(err)
				}
			}))
			h.ServeHTTP(origResp, origReq.WithContext(context.WithValue(origReq.Context(), routeKey{}, c.Path())))
			c.SetRequest(origReq)
			c.SetResponse(origResp)
			return passErr
		}
	}
}

// Operation is an idemhttp Config.Operation for echo: the method and the
// route echo matched (c.Path(), as "/orders/:id"), or the request path for
// a catch-all route ("/files/*") or when the request did not come through
// [Middleware]; see idemhttp.RouteOperation.
func Operation(r *http.Request) (string, error) {
	route, _ := r.Context().Value(routeKey{}).(string)
	return idemhttp.RouteOperation(r, route), nil
}
