package replicated

import "sync"

// volumeSet is the set of degraded volumes' names, which the metric counts.
type volumeSet struct {
	mu    sync.Mutex
	names map[string]bool
}

var degraded = &volumeSet{names: map[string]bool{}}

func (s *volumeSet) set(name string, in bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if in {
		s.names[name] = true
	} else {
		delete(s.names, name)
	}
}

func (s *volumeSet) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.names)
}
