// runtime/signals.h: the room of signals: faults, the launch's time limit, flush-to-zero.
//
// Part of runtime.cpp, a unity build: runtime.cpp includes its parts, in order, into one
// translation unit (one object, compiled once per toolchain, as before the split); include
// it nowhere else. It uses what the parts before it declare.
//
// A fault (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) during a launch is caught on an alternate
// stack and turned into a report; the CPU-time timer of the launching thread ends a launch that runs
// past its limit (TimeLimit); the floating-point control bits make -ftz=true flush subnormals.

namespace {

// ----------------------------------------------------------------------------
// signals

constexpr int kCaught[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
struct sigaction previous[std::size(kCaught)];
stack_t previous_altstack;

// The launch's time limit: a CPU-time timer of the launching thread, signalling that thread only
// (fibers never preempt one another, so a thread spinning on a flag that another thread sets
// would otherwise hang the launch).
constexpr int kTimerSignal = SIGVTALRM;
#ifndef sigev_notify_thread_id
#define sigev_notify_thread_id _sigev_un._tid
#endif

void on_timer(int, siginfo_t*, void*) {
    if (!active) return;
    if (active->current) record_thread(*active->current);
    std::snprintf(active->report->message, sizeof active->report->message,
                  "the launch ran past its time limit of %g s of CPU time (EmulatedModule's time_limit); "
                  "a thread that spins on memory another thread writes never lets that thread run here "
                  "(fibers are cooperative: wait with a barrier or mbarrier instead)",
                  active->config->time_limit);
    siglongjmp(active->escape, kTimeout);
}

void on_signal(int sig, siginfo_t* info, void* context) {
    if (!active) {  // not raised by a kernel: hand it to whoever handled it before us
        for (std::size_t i = 0; i < std::size(kCaught); ++i)
            if (kCaught[i] == sig) sigaction(sig, &previous[i], nullptr);
        return;
    }
    EmuLaunchReport& r = *active->report;
    auto address = reinterpret_cast<std::uintptr_t>(info->si_addr);
    r.signal = sig;
    r.fault_address = address;
#if defined(__x86_64__)
    if (sig == SIGSEGV) {  // bit 1 of the page-fault error code: the access was a write
        auto* uc = static_cast<ucontext_t*>(context);
        r.access = (uc->uc_mcontext.gregs[REG_ERR] & 2) ? kWrite : kRead;
    }
#else
    (void)context;
#endif
    if (active->shared.in_guard(address)) r.where = kDynamicShared;
    else if (stacks.in_guard(address)) r.where = kStack;
    if (active->current) record_thread(*active->current);
    siglongjmp(active->escape, kFault);
}

// The floating-point control state, and the bits that make it flush subnormal operands and results
// to zero. x86's MXCSR (FTZ, DAZ) and AArch64's FPCR.FZ apply to double as well as float, where
// -ftz=true flushes float only.
#if defined(__x86_64__) || defined(__i386__)
unsigned float_control() { return _mm_getcsr(); }
void set_float_control(unsigned c) { _mm_setcsr(c); }
constexpr unsigned kFlushToZero = 0x8040;  // FTZ | DAZ
#elif defined(__aarch64__)
unsigned float_control() { return __builtin_aarch64_get_fpcr(); }
void set_float_control(unsigned c) { __builtin_aarch64_set_fpcr(c); }
constexpr unsigned kFlushToZero = 1u << 24;  // FZ
#else
unsigned float_control() { return 0; }
void set_float_control(unsigned) {}
constexpr unsigned kFlushToZero = 0;  // unknown here: a launch asking for it fails
#endif

void install_handlers() {
    static unsigned char* altstack = nullptr;
    const std::size_t altstack_bytes = 64 * 1024;
    if (!altstack) altstack = static_cast<unsigned char*>(mmap(nullptr, altstack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    stack_t ss{};
    ss.ss_sp = altstack;
    ss.ss_size = altstack_bytes;
    sigaltstack(&ss, &previous_altstack);
    struct sigaction action {};
    action.sa_sigaction = &on_signal;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    for (std::size_t i = 0; i < std::size(kCaught); ++i) sigaction(kCaught[i], &action, &previous[i]);
}

void restore_handlers() {
    for (std::size_t i = 0; i < std::size(kCaught); ++i) sigaction(kCaught[i], &previous[i], nullptr);
    sigaltstack(&previous_altstack, nullptr);
}

// The time limit of one launch: a CPU-time timer of the launching thread, whose signal (on_timer)
// abandons the launch. start() before the grid runs, stop() after, whatever way it ended.
struct TimeLimit {
    timer_t timer{};
    bool timed = false;      // the timer exists
    bool handled = false;    // on_timer is installed, `previous` saved
    struct sigaction previous {};

    void start(double seconds) {
        if (!(seconds > 0)) return;
        struct sigaction action {};
        action.sa_sigaction = &on_timer;
        action.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&action.sa_mask);
        sigaction(kTimerSignal, &action, &previous);
        handled = true;
        sigevent event{};
        event.sigev_notify = SIGEV_THREAD_ID;
        event.sigev_signo = kTimerSignal;
        event.sigev_notify_thread_id = static_cast<pid_t>(gettid());
        timed = timer_create(CLOCK_THREAD_CPUTIME_ID, &event, &timer) == 0;
        if (timed) {
            itimerspec limit{};
            limit.it_value.tv_sec = static_cast<time_t>(seconds);
            const double fraction = seconds - static_cast<double>(limit.it_value.tv_sec);
            limit.it_value.tv_nsec = static_cast<long>(fraction * 1e9);
            timer_settime(timer, 0, &limit, nullptr);
        }
    }

    void stop() {
        if (timed) timer_delete(timer);
        if (handled) sigaction(kTimerSignal, &previous, nullptr);
    }
};

}  // namespace
