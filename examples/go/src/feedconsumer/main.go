// A Go consumer of prorl's event feed: Subscribe with a filter, one JSON line
// per matching event on stdout, and a cursor file that lets it stop and go on
// later without a gap or a duplicate.
//
// Events come in batches (SubscribeResponse.events). Once a batch is printed
// (or a progress mark comes: no event matched up to there), its cursor is
// written to -cursor-file atomically (a temporary file, fsync, rename): one
// write per message, not per event, so the consumer keeps up with a fast
// feed. At start, a non-empty cursor file says where
// to go on; without one, -from says where to begin ("now" or "oldest").
//
// When the stream ends with RESOURCE_EXHAUSTED (this consumer lost ground) or
// UNAVAILABLE (its server went away), it subscribes again after the last
// cursor it processed: its own, not the one the server puts in the trailing
// metadata `prorl-resume-cursor` (a server that went away sends none), which
// it logs beside its own. Behind retention (OUT_OF_RANGE) it exits with
// status 3 and says what to do; other errors exit 1.
//
// It stops (status 0) after -max-events events, after -idle without an
// event, or on SIGINT/SIGTERM: the batch being processed is printed and its
// cursor saved first, so a stopped consumer started again with the same
// cursor file prints each event once. Killed with SIGKILL, the events of a
// batch printed but not yet saved would be printed again.
//
// Usage:
//
//	feed-consumer -server localhost:50051 -cursor-file run.cursor -kinds finished
//	feed-consumer -server localhost:50051 -group g1 -label run=a -status succeeded,running -from oldest -idle 30s
//
// Output, one line per event:
//
//	{"job_id":"j1","seq":9,"kind":"finished","attempt":1,"cursor":"...","store_time":"...","status":"JOB_STATUS_SUCCEEDED","reward":1}
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math/rand"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	prorlv1 "prorl/gen/prorlv1"
)

const (
	resumeCursorKey = "prorl-resume-cursor"
	exitExpired     = 3
	// idleGrace is how long -idle waits, once its time is up, for a message
	// already on its way.
	idleGrace = 250 * time.Millisecond
)

func main() {
	var handlers, groups, labels, statuses, kinds list
	server := flag.String("server", "localhost:50051", "gRPC target of the prorl server (host:port, dns:///name:port)")
	flag.Var(&handlers, "handler", "only jobs of this handler (repeat or comma-separate for several)")
	flag.Var(&groups, "group", "only jobs of this group id (repeat or comma-separate for several)")
	flag.Var(&labels, "label", "only jobs carrying this label, key=value (repeat: all of them)")
	flag.Var(&statuses, "status", "the job's status as of the event: queued, running, succeeded, failed, cancelled, timed_out (repeat or comma-separate)")
	flag.Var(&kinds, "kinds", "event kinds, e.g. finished,model_turn (repeat or comma-separate)")
	cursorFile := flag.String("cursor-file", "", "where to keep the cursor: read at start, rewritten after each message (a batch of events, or a progress mark) processed")
	from := flag.String("from", "now", `where to begin without a saved cursor: "now" or "oldest"`)
	maxEvents := flag.Int("max-events", 0, "stop after this many events (0: no limit)")
	idle := flag.Duration("idle", 0, "stop after this long without an event, e.g. 30s (0: never)")
	retries := flag.Int("retries", 5, "times in a row a broken stream is resumed without a new message in between")
	token := flag.String("token", os.Getenv("PRORL_TOKEN"), "bearer token, if the server wants one")
	timeout := flag.Duration("timeout", 0, "give up after this long (0: never)")
	flag.Parse()
	log.SetPrefix("feed-consumer: ")
	log.SetFlags(log.Ltime | log.Lmicroseconds)

	filter, err := makeFilter(handlers, groups, labels, statuses, kinds)
	if err != nil {
		log.Fatal(err)
	}
	cursor, err := startingPoint(*cursorFile, *from)
	if err != nil {
		log.Fatal(err)
	}

	ctx := context.Background()
	if *timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *timeout)
		defer cancel()
	}
	if *token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+*token)
	}
	conn, err := grpc.DialContext(ctx, *server, grpc.WithInsecure(),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(codec{})))
	if err != nil {
		log.Fatalf("connect %s: %v", *server, err)
	}
	defer conn.Close()

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	c := &consumer{
		client:    prorlv1.NewRolloutServiceClient(conn),
		filter:    filter,
		cursor:    cursor,
		file:      *cursorFile,
		maxEvents: *maxEvents,
		idle:      *idle,
		stop:      stop,
	}
	os.Exit(c.run(ctx, *retries))
}

type consumer struct {
	client    prorlv1.RolloutServiceClient
	filter    *prorlv1.EventFilter
	cursor    string // the last message processed: where the next Subscribe begins
	file      string
	maxEvents int
	idle      time.Duration
	stop      <-chan os.Signal

	events, resumed int
	lastEvent       time.Time
}

// run subscribes, and again after each resumable error, until a stop condition
// holds; the exit status.
func (c *consumer) run(ctx context.Context, retries int) int {
	c.lastEvent = time.Now()
	failures := 0
	for {
		before := c.cursor
		reason, trailer, err := c.follow(ctx)
		if err == nil {
			log.Printf("stopped (%s) after %d events, %d resumptions; cursor %s", reason, c.events, c.resumed, c.cursor)
			return 0
		}
		if ctx.Err() != nil {
			log.Printf("timed out (-timeout) after %d events; cursor %s", c.events, c.cursor)
			return 1
		}
		code := status.Code(err)
		if code == codes.OutOfRange {
			log.Printf("the events after cursor %s were deleted by the server's retention (subscribe.retain_s): "+
				"they cannot be read any more. To go on and accept the gap, remove the cursor file and start with "+
				"-from oldest (or -from now). Server: %s", c.cursor, status.Convert(err).Message())
			return exitExpired
		}
		// A stopping server cancels its calls: Canceled here is the server's (ours is ctx.Err above).
		if code != codes.ResourceExhausted && code != codes.Unavailable && code != codes.Canceled {
			log.Printf("Subscribe failed: %v", err)
			return 1
		}
		if c.cursor != before {
			failures = 0 // the stream got somewhere before it broke
		}
		if failures >= retries {
			log.Printf("giving up after %d resumptions in a row without a new message: %v", failures, err)
			return 1
		}
		log.Printf("stream ended with %s (%s); the server's resume cursor: %q; resuming after ours: %q",
			code, status.Convert(err).Message(), trailer, c.cursor)
		if trailer != "" && trailer != c.cursor {
			log.Printf("the server's resume cursor differs from the last one processed here; going on after ours")
		}
		delay := 5 * time.Second
		if failures < 6 {
			delay = 100 * time.Millisecond << failures // 0.1 s, 0.2 s, ... 3.2 s, then 5 s
		}
		failures++
		c.resumed++
		select {
		case <-time.After(delay/2 + time.Duration(rand.Int63n(int64(delay/2)+1))):
		case <-c.stop:
			log.Printf("stopped (signal) after %d events, %d resumptions; cursor %s", c.events, c.resumed, c.cursor)
			return 0
		case <-ctx.Done():
			log.Printf("timed out (-timeout) after %d events; cursor %s", c.events, c.cursor)
			return 1
		}
	}
}

type received struct {
	response *prorlv1.SubscribeResponse
	err      error
}

// follow runs one Subscribe stream from c.cursor. It returns why it stopped
// (nil error), or the stream's error and the cursor of its trailing metadata.
func (c *consumer) follow(ctx context.Context) (string, string, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.client.Subscribe(ctx, &prorlv1.SubscribeRequest{Filter: c.filter, AfterCursor: c.cursor})
	if err != nil {
		return "", "", err
	}
	// One reader: it holds at most the message being handed over, so what is not
	// processed yet stays with gRPC's flow control (and the server sees the lag).
	messages := make(chan received)
	go func() {
		for {
			response, err := stream.Recv()
			select {
			case messages <- received{response, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	var idle <-chan time.Time
	if c.idle > 0 {
		timer := time.NewTimer(time.Until(c.lastEvent.Add(c.idle)))
		defer timer.Stop()
		idle = timer.C
	}
	// After a freeze (a suspended process or machine) the idle timer and a message
	// gRPC already holds are ready together; a short grace lets the message win.
	grace := false
	for {
		select {
		case <-c.stop:
			return "signal", "", nil
		case <-idle:
			if wait := time.Until(c.lastEvent.Add(c.idle)); wait > 0 {
				idle = time.After(wait)
				continue
			}
			if !grace {
				grace = true
				idle = time.After(idleGrace)
				continue
			}
			return fmt.Sprintf("idle for %s", c.idle), "", nil
		case <-ctx.Done():
			return "", "", ctx.Err()
		case m := <-messages:
			grace = false
			if m.err == io.EOF {
				// The server never ends a stream cleanly: treat it as a server gone away.
				return "", "", status.Error(codes.Unavailable, "the stream ended without a status")
			}
			if m.err != nil {
				trailer := ""
				if values := stream.Trailer().Get(resumeCursorKey); len(values) > 0 {
					trailer = values[0]
				}
				return "", trailer, m.err
			}
			done, err := c.process(m.response)
			if err != nil {
				log.Fatalf("save the cursor: %v", err)
			}
			if done {
				return fmt.Sprintf("-max-events %d reached", c.maxEvents), "", nil
			}
		}
	}
}

// process prints the response's events (a batch; a progress mark has none),
// then saves one cursor: the response's, or the last printed event's when
// -max-events stops it within the batch (done is then true).
func (c *consumer) process(response *prorlv1.SubscribeResponse) (bool, error) {
	cursor, done := response.Cursor, false
	for _, item := range response.Events {
		line, err := json.Marshal(describe(item))
		if err != nil {
			return false, err
		}
		if _, err := os.Stdout.Write(append(line, '\n')); err != nil {
			return false, err
		}
		c.events++
		c.lastEvent = time.Now()
		if c.maxEvents > 0 && c.events >= c.maxEvents {
			cursor, done = item.Cursor, true
			break
		}
	}
	c.cursor = cursor
	return done, saveCursor(c.file, c.cursor)
}

type output struct {
	JobID     string   `json:"job_id"`
	Seq       int64    `json:"seq"`
	Kind      string   `json:"kind"`
	Attempt   int32    `json:"attempt"`
	Cursor    string   `json:"cursor"`
	StoreTime string   `json:"store_time"`
	Status    string   `json:"status,omitempty"`
	Reward    *float64 `json:"reward,omitempty"`
}

func describe(item *prorlv1.FeedEvent) output {
	event := item.GetEvent()
	line := output{
		JobID:     event.JobId,
		Seq:       event.Seq,
		Kind:      kind(event),
		Attempt:   item.Attempt,
		Cursor:    item.Cursor,
		StoreTime: item.GetStoreTime().AsTime().Format(time.RFC3339Nano),
	}
	if finished := event.GetFinished(); finished != nil {
		reward := finished.GetResult().GetReward()
		line.Status = finished.GetResult().GetStatus().String()
		line.Reward = &reward
	}
	return line
}

// kind is the name of the event's oneof field, e.g. "model_turn".
func kind(event *prorlv1.RolloutEvent) string {
	message := event.ProtoReflect()
	field := message.WhichOneof(message.Descriptor().Oneofs().ByName("kind"))
	if field == nil {
		return "unknown"
	}
	return string(field.Name())
}

func makeFilter(handlers, groups, labels, statuses, kinds list) (*prorlv1.EventFilter, error) {
	filter := &prorlv1.EventFilter{Handlers: handlers, GroupIds: groups, EventKinds: kinds}
	for _, label := range labels {
		key, value, found := strings.Cut(label, "=")
		if !found || key == "" {
			return nil, fmt.Errorf("-label %q: expected key=value", label)
		}
		if filter.Labels == nil {
			filter.Labels = map[string]string{}
		}
		filter.Labels[key] = value
	}
	for _, name := range statuses {
		full := strings.ToUpper(name)
		if !strings.HasPrefix(full, "JOB_STATUS_") {
			full = "JOB_STATUS_" + full
		}
		number, found := prorlv1.JobStatus_value[full]
		if !found || number == 0 {
			return nil, fmt.Errorf("-status %q: not a job status (queued, running, succeeded, failed, cancelled, timed_out)", name)
		}
		filter.Statuses = append(filter.Statuses, prorlv1.JobStatus(number))
	}
	return filter, nil
}

// startingPoint is the saved cursor, or -from when there is none.
func startingPoint(file, from string) (string, error) {
	if file != "" {
		saved, err := os.ReadFile(file)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return "", fmt.Errorf("read the cursor file: %w", err)
		}
		if cursor := strings.TrimSpace(string(saved)); cursor != "" {
			log.Printf("going on after the cursor saved in %s: %s", file, cursor)
			return cursor, nil
		}
	}
	switch from {
	case "now":
		return "", nil
	case "oldest":
		return "oldest", nil
	}
	return "", fmt.Errorf(`-from %q: expected "now" or "oldest"`, from)
}

// saveCursor replaces the file's content at once: a reader (or this program
// started again after a kill) sees the old cursor or the new one, never a mix.
func saveCursor(file, cursor string) error {
	if file == "" {
		return nil
	}
	temporary, err := os.CreateTemp(filepath.Dir(file), "."+filepath.Base(file)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(temporary.Name()) // fails harmlessly once renamed
	if _, err := temporary.WriteString(cursor + "\n"); err != nil {
		temporary.Close()
		return err
	}
	if err := temporary.Sync(); err != nil {
		temporary.Close()
		return err
	}
	if err := temporary.Close(); err != nil {
		return err
	}
	return os.Rename(temporary.Name(), file)
}

// list is a flag that may be repeated and takes comma-separated values.
type list []string

func (l *list) String() string { return strings.Join(*l, ",") }

func (l *list) Set(value string) error {
	for _, item := range strings.Split(value, ",") {
		if item = strings.TrimSpace(item); item != "" {
			*l = append(*l, item)
		}
	}
	return nil
}

// codec marshals with the current protobuf runtime (google.golang.org/protobuf):
// Debian's grpc-go 1.33 defaults to the legacy marshaller, which cannot encode
// the oneofs of today's generated messages (see rolloutclient).
type codec struct{}

func (codec) Marshal(v interface{}) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }

func (codec) Unmarshal(data []byte, v interface{}) error {
	return proto.Unmarshal(data, v.(proto.Message))
}

func (codec) Name() string { return "proto" }
