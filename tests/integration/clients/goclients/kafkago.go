package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/segmentio/kafka-go"
)

type kafkaGo struct{}

type kgMsg struct {
	m   kafka.Message
	err error
}

func kgHeaders(hs []kafka.Header) []header {
	var out []header
	for _, h := range hs {
		out = append(out, header{h.Key, h.Value})
	}
	return out
}

// partitionReaders: one Reader per partition from offset 0, their messages on one channel.
func kgPartitionReaders(ctx context.Context, bs, topic string, n int) ([]*kafka.Reader, chan kgMsg) {
	ch := make(chan kgMsg, 1024)
	var rs []*kafka.Reader
	for p := 0; p < n; p++ {
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: []string{bs}, Topic: topic, Partition: p,
			MinBytes: 1, MaxBytes: 10 << 20, MaxWait: 500 * time.Millisecond,
			IsolationLevel: kafka.ReadCommitted})
		if err := r.SetOffset(0); err != nil {
			fail("SetOffset: %v", err)
		}
		rs = append(rs, r)
		go func(r *kafka.Reader) {
			for {
				m, err := r.FetchMessage(ctx)
				if err != nil {
					if ctx.Err() == nil {
						ch <- kgMsg{err: err}
					}
					return
				}
				ch <- kgMsg{m: m}
			}
		}(r)
	}
	return rs, ch
}

func kgHWM(bs, topic string, n int) map[int]int64 {
	o := kgListOffsets(bs, topic, n)
	out := map[int]int64{}
	for p, v := range o["latest"] {
		out[p] = v
	}
	return out
}

// kgToEnd: messages until every last record came, then until each partition's messages taken
// from the channel reach the high watermark (settle at most); the readers' offsets. (Not the
// readers' Offset(): FetchMessage moves it before its message is on the channel, so a control
// record at the high watermark - 1 could still be on its way.)
func kgToEnd(t *tracker, ch chan kgMsg, rs []*kafka.Reader, hwm map[int]int64) map[int]int64 {
	end := time.After(readTimeout)
	for !t.done() {
		select {
		case m := <-ch:
			if m.err != nil {
				fail("FetchMessage: %v", m.err)
			}
			t.add(m.m.Partition, m.m.Offset, m.m.Time, m.m.Key, m.m.Value, kgHeaders(m.m.Headers))
		case <-end:
			fail("not every record came in 30 s: %s", t.missing())
		}
	}
	behind := func() bool {
		for p := range rs {
			if t.seen[p]+1 < hwm[p] {
				return true
			}
		}
		return false
	}
	stop := time.After(settle)
	for behind() {
		select {
		case m := <-ch:
			if m.err != nil {
				fail("FetchMessage: %v", m.err)
			}
			t.add(m.m.Partition, m.m.Offset, m.m.Time, m.m.Key, m.m.Value, kgHeaders(m.m.Headers))
		case <-time.After(100 * time.Millisecond):
		case <-stop:
			goto out
		}
	}
out:
	pos := map[int]int64{}
	for p, r := range rs {
		pos[p] = r.Offset()
	}
	return pos
}

func (kafkaGo) read(bs, topic string, lasts []int64) {
	t := newTracker(topic, lasts, false)
	ctx, cancel := context.WithCancel(context.Background())
	hwm := kgHWM(bs, topic, len(lasts))
	rs, ch := kgPartitionReaders(ctx, bs, topic, len(lasts))
	pos := kgToEnd(t, ch, rs, hwm)
	emit(map[string]any{"positions": intKeys(pos)})
	cancel()
	for _, r := range rs {
		r.Close()
	}
}

func (kafkaGo) idle(bs, topic string, lasts []int64, d time.Duration) {
	t := newTracker(topic, lasts, true)
	ctx, cancel := context.WithCancel(context.Background())
	hwm := kgHWM(bs, topic, len(lasts))
	rs, ch := kgPartitionReaders(ctx, bs, topic, len(lasts))
	kgToEnd(t, ch, rs, hwm)
	emit(map[string]any{"idle": "start"})
	before := t.count
	stop := time.After(d)
	func() {
		for {
			select {
			case m := <-ch:
				if m.err != nil {
					fail("FetchMessage: %v", m.err)
				}
				t.add(m.m.Partition, m.m.Offset, m.m.Time, m.m.Key, m.m.Value, nil)
			case <-stop:
				return
			}
		}
	}()
	emit(map[string]any{"idle": "end", "records": t.count - before})
	cancel()
	for _, r := range rs {
		r.Close()
	}
}

func (kafkaGo) group(bs, topic string, lasts []int64, group string, n int) {
	t := newTracker(topic, lasts, false)
	cfg := kafka.ReaderConfig{Brokers: []string{bs}, Topic: topic, GroupID: group,
		MinBytes: 1, MaxBytes: 10 << 20, MaxWait: 500 * time.Millisecond,
		IsolationLevel: kafka.ReadCommitted, StartOffset: kafka.FirstOffset}
	// the first member: n records, committed, closed
	r := kafka.NewReader(cfg)
	ctx, cancel := context.WithTimeout(context.Background(), readTimeout)
	for t.count < n {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			fail("the first member got %d of %d records: %v", t.count, n, err)
		}
		t.add(m.Partition, m.Offset, m.Time, m.Key, m.Value, kgHeaders(m.Headers))
		if err := r.CommitMessages(ctx, m); err != nil {
			fail("CommitMessages: %v", err)
		}
	}
	cancel()
	r.Close()
	// the second: resumes to the end, commits each message
	r = kafka.NewReader(cfg)
	ctx, cancel = context.WithTimeout(context.Background(), readTimeout)
	for !t.done() {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			fail("not every record came in 30 s: %s (%v)", t.missing(), err)
		}
		t.add(m.Partition, m.Offset, m.Time, m.Key, m.Value, kgHeaders(m.Headers))
		if err := r.CommitMessages(ctx, m); err != nil {
			fail("CommitMessages: %v", err)
		}
	}
	cancel()
	// a few seconds more, each message committed as an application commits what it handles
	// (a control record the endpoint ends a partition's gap with comes in a fetch of its own,
	// after the last record; Kafka's comes with it): a record delivered again fails here
	ctx, cancel = context.WithTimeout(context.Background(), 3*time.Second)
	for {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			break
		}
		t.add(m.Partition, m.Offset, m.Time, m.Key, m.Value, kgHeaders(m.Headers))
		if err := r.CommitMessages(context.Background(), m); err != nil {
			fail("CommitMessages: %v", err)
		}
	}
	cancel()
	r.Close()
	cl := &kafka.Client{Addr: kafka.TCP(bs), Timeout: 10 * time.Second}
	var parts []int
	for p := range lasts {
		parts = append(parts, p)
	}
	resp, err := cl.OffsetFetch(context.Background(), &kafka.OffsetFetchRequest{GroupID: group,
		Topics: map[string][]int{topic: parts}})
	if err != nil {
		fail("OffsetFetch: %v", err)
	}
	committed := map[int]int64{}
	for _, p := range resp.Topics[topic] {
		committed[p.Partition] = p.CommittedOffset
	}
	emit(map[string]any{"committed": intKeys(committed)})
}

func kgListOffsets(bs, topic string, n int) map[string]map[int]int64 {
	cl := &kafka.Client{Addr: kafka.TCP(bs), Timeout: 10 * time.Second}
	var reqs []kafka.OffsetRequest
	for p := 0; p < n; p++ {
		reqs = append(reqs, kafka.FirstOffsetOf(p), kafka.LastOffsetOf(p))
	}
	resp, err := cl.ListOffsets(context.Background(), &kafka.ListOffsetsRequest{
		Topics: map[string][]kafka.OffsetRequest{topic: reqs}, IsolationLevel: kafka.ReadCommitted})
	if err != nil {
		fail("ListOffsets: %v", err)
	}
	out := map[string]map[int]int64{"earliest": {}, "latest": {}}
	for _, po := range resp.Topics[topic] {
		if po.Error != nil {
			fail("ListOffsets partition %d: %v", po.Partition, po.Error)
		}
		out["earliest"][po.Partition] = po.FirstOffset
		out["latest"][po.Partition] = po.LastOffset
	}
	return out
}

func (kafkaGo) offsets(bs, topic string, partitions int) {
	o := kgListOffsets(bs, topic, partitions)
	emit(map[string]any{"earliest": intKeys(o["earliest"]), "latest": intKeys(o["latest"])})
}

func (kafkaGo) produce(bs, topic string) {
	// acks=all: with kafka-go's default (RequireNone, acks=0) no broker answers a produce, so
	// a refusal cannot be seen (the endpoint closes the connection, Kafka's way for acks=0)
	w := &kafka.Writer{Addr: kafka.TCP(bs), Topic: topic, RequiredAcks: kafka.RequireAll}
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := w.WriteMessages(ctx, kafka.Message{Key: []byte("k"), Value: []byte("v")})
	if err == nil {
		emit(map[string]any{"produced": true})
		return
	}
	var we kafka.WriteErrors
	if errors.As(err, &we) && len(we) == 1 && we[0] != nil {
		err = we[0]
	}
	emit(map[string]any{"produce_error": fmt.Sprintf("%T: %v", err, err)})
}
